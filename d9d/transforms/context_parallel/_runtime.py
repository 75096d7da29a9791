"""Context parallelism at run time: the batch cut along the sequence before the step body
runs, the global positions of the rank's tokens passed to the model, and ring attention.

The d9d Llama's attention asks the running step for its ``"attention"`` op
(:func:`d9d.core._context.sequence_attention`); a Hugging Face
model is switched to the ``"d9d_ring"`` attention implementation for the call, once
``_hf_refusals.py`` finds nothing in it that mixes positions outside that attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed

from ... import errors
from ...core._runtime import ApplyCall, Interception, Runtime
from ...core._structure import Block, Structure
from ._hf_refusals import (
    check_block_attended,
    check_hf_chunks,
    check_hf_inputs,
    check_hf_layers,
    check_hf_rope,
    per_token_layer,
    unattended_failure_note,
)
from ._split import (
    HF_ATTENTION,
    SEQUENCE_DIM,
    SequenceSplit,
    hf_config,
    sequence_input,
    with_positions,
)

__all__ = ["ContextParallelRuntime"]

# Errors a block's own attention code does not cause: d9d's refusals (dropout, a mask of the
# module's own, ... raised by the "d9d_ring" attention itself), memory, collectives; they get
# no note saying its attention may be its own code.
_NOT_ATTENTION_CODE: tuple[type[BaseException], ...] = (
    *(getattr(errors, name) for name in errors.__all__),
    torch.OutOfMemoryError,
    torch.distributed.DistError,
)


class ContextParallelRuntime(Runtime):
    """The runtime of ``context_parallel``."""

    def __init__(self, split: SequenceSplit) -> None:
        self.split = split
        self._passed: list[Structure] = []  # the models whose layers passed check_layers
        self._attentions = 0  # ring attention calls so far: a block's are counted around it

    def op(self, name: str) -> Callable[..., Any] | None:
        ops = {"attention": self._attention, "sequence_length": self.split.whole_length}
        return ops.get(name)

    def _attention(self, *args: Any, **kwargs: Any) -> Any:
        self._attentions += 1
        return self.split.attention(*args, **kwargs)

    def on_batch(self, batch: Any) -> Any:
        return self.split.split_batch(batch)

    def enter_apply(self, call: ApplyCall) -> None:
        # Set at every call of every model, not carried over: a count a jitted step kept
        # across calls was a guard that failed on each next call (a graph per call).
        self._attentions = 0
        structure = call.structure
        config = hf_config(structure.module)
        if config is not None:  # the call's own inputs, before the positions added here
            self.check_layers(structure)
            check_hf_inputs(structure, call.args, call.kwargs)
        call.kwargs = with_positions(self.split, structure, call.args, call.kwargs)
        if config is None:
            return
        local = sequence_input(call.args, call.kwargs).shape[SEQUENCE_DIM]
        whole = self.split.whole_length(local)
        check_hf_chunks(config, whole)
        check_hf_rope(config, whole)
        call.override(config, "_attn_implementation", HF_ATTENTION)
        for block in structure.blocks:
            if not per_token_layer(config, block.index):
                call.intercept(block.path, Interception(around=self._attending(call, block)))

    def _attending(self, call: ApplyCall, block: Block) -> Callable[..., Any]:
        """Run ``block`` and refuse it if it called no ring attention: a Hugging Face block
        whose attention is its own code (GPT-Neo's, OpenAI GPT's), not ``transformers``'
        attention interface, attended over the rank's slice only, with no error; one that
        fails before calling it gets a note naming it (Falcon's attention, its own code, adds
        the mask it expects and meets None). A stand-in (another pipeline stage's block) is
        not checked: runtimes after this one put it in."""

        def around(forward: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> Any:
            before = self._attentions
            try:
                out = forward(*args, **kwargs)
            except Exception as error:
                if (
                    self._attentions == before
                    and not call.stood_in(block.path)
                    and not isinstance(error, _NOT_ATTENTION_CODE)
                ):
                    error.add_note(unattended_failure_note(block))
                raise
            if not call.stood_in(block.path):
                check_block_attended(block, self._attentions - before)
            return out

        return around

    def check_layers(self, structure: Structure) -> None:
        """Refuse a Hugging Face model whose layers ring attention cannot split; once per
        model (``place`` checks it when given the model, before any compile)."""
        config = hf_config(structure.module)
        if config is None or any(s is structure for s in self._passed):
            return
        check_hf_layers(structure, config)
        self._passed.append(structure)
