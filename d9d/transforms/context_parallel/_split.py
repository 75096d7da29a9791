"""How ``context_parallel`` splits sequences: this rank's part of the batch, the global
positions of its tokens, and attention over the whole sequence (ring attention)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ... import tree
from ...core._context import sequence_attention, sequence_length
from ...core._hidden_tensors import refuse_hidden_tensors
from ...core._structure import Structure
from ...errors import IndivisibleError, PlanError
from ...kernels._registry import resolve
from ...parallel import positions_for, shard_sequence
from ...parallel._ring_attention import ring_attention_on
from ._hf_refusals import HF_ATTENTION, attention_window, check_attention_call

__all__ = ["HF_ATTENTION", "SequenceSplit", "hf_config", "sequence_input", "with_positions"]

SEQUENCE_DIM = 1


@dataclass(frozen=True)
class SequenceSplit:
    """How ``context_parallel`` splits sequences.

    Attributes:
        group_name: The name of the cp axis's process group (a name, not the group: ``jit``
            traces the attention, and torch 2.11's Dynamo cannot trace every group object).
        axis: The axis's name.
        rank: This rank's coordinate on it.
        size: Ranks on it.
        load_balance: ``"zigzag"`` or None (contiguous chunks).
    """

    group_name: str
    axis: str
    rank: int
    size: int
    load_balance: str | None

    def split_batch(self, batch: Any) -> Any:
        """Every tensor of rank >= 2 in ``batch`` cut to this rank's shard of dim 1.

        Raises:
            IndivisibleError: Leaves disagree on dim 1, or it does not cut into the layout's
                equal chunks.
            TypeError: A leaf hides tensors from the pytree (a dataclass; a mapping not a
                dict), which every rank would take whole.
        """
        _refuse_mixed_lengths(batch)

        def cut(path: str, leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                name = f"batch leaf {path!r}" if path else "the batch"
                refuse_hidden_tensors(name, leaf, f"{self.size} sequence slices", min_ndim=2)
                return leaf
            if leaf.ndim <= SEQUENCE_DIM:
                return leaf
            chunks = 2 * self.size if self.load_balance == "zigzag" else self.size
            if leaf.shape[SEQUENCE_DIM] % chunks:
                raise IndivisibleError(
                    f"batch leaf {path!r} {tuple(leaf.shape)}: its sequence length "
                    f"{leaf.shape[SEQUENCE_DIM]} (dim 1, which context_parallel cuts in every "
                    f"batch tensor of rank >= 2) does not split into {chunks} equal chunks "
                    f"(load_balance={self.load_balance!r}, {self.axis}={self.size}): pad or "
                    f"pack sequences to a multiple of {chunks}"
                )
            return shard_sequence(
                leaf, SEQUENCE_DIM, self.rank, self.size, load_balance=self.load_balance
            )

        return tree.map_with_path(cut, batch)

    def whole_length(self, local_len: int) -> int:
        """The length of the sequence of which this rank holds ``local_len`` positions."""
        return local_len * self.size

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens, in local order."""
        whole = self.whole_length(local_len)
        found = positions_for(self.rank, self.size, whole, load_balance=self.load_balance)
        return found.to(device)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        scale: float | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of this rank's queries over the whole sequence; ``[B, H, S_local, D]``.

        Each block's attention comes from the kernel registry's ``block_attention`` op. A
        causal sliding ``window`` lets a query see keys at most ``window - 1`` positions back
        (see :func:`d9d.parallel.ring_attention`); ``sinks`` ``[H]`` are attention sinks.

        Raises:
            PlanError: A ``window`` shorter than the sequence without ``causal``.
        """
        whole = self.whole_length(q.shape[-2])
        if window is not None and window < whole and not causal:
            raise PlanError(
                f"the model attends over a bidirectional sliding window of {window} positions, "
                f"shorter than the sequence ({whole}), which context_parallel's ring attention "
                "does not implement (it computes causal windows only); train on sequences no "
                "longer than the window, or without context_parallel"
            )
        return ring_attention_on(
            q,
            k,
            v,
            group_name=self.group_name,
            rank=self.rank,
            size=self.size,
            causal=causal,
            load_balance=self.load_balance,
            scale=scale,
            block=resolve("block_attention", q, None),
            sinks=sinks,
            window=window,
        )


def _refuse_mixed_lengths(batch: Any) -> None:
    """Raise unless every tensor of rank >= 2 in ``batch`` has one length on dim 1: one whose
    dim 1 is not the sequence (a per-example ``[B, 4]`` beside tokens ``[B, 16]``) was cut
    like one, each rank taking some of its columns, whenever the chunks divided it."""
    lengths = {
        path: leaf.shape[SEQUENCE_DIM]
        for path, leaf in tree.flatten_with_paths(batch)[0]
        if isinstance(leaf, torch.Tensor) and leaf.ndim > SEQUENCE_DIM
    }
    if len(set(lengths.values())) > 1:
        raise IndivisibleError(
            f"batch leaves disagree on the sequence length (dim 1, which context_parallel cuts "
            f"in every batch tensor of rank >= 2): {lengths}; give every such tensor the "
            "tokens' sequence length, and pass values per example as tensors of rank 1 "
            "([B], which every rank takes whole)"
        )


def with_positions(
    split: SequenceSplit, structure: Structure, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """``kwargs`` with the rank's global positions added under the model's positions
    keyword, unless the call passes its own (by keyword or position)."""
    name = structure.positions_keyword
    if name is None:
        raise PlanError(
            "context_parallel gives each rank a slice of every sequence, so the model must "
            "take the tokens' global positions: its forward has neither positions= nor "
            "position_ids= (an ALiBi model, as Bloom or MPT, biases attention by distances "
            "it computes over the tokens it is given, this rank's slice); train it without "
            "context_parallel"
        )
    if structure.given_inputs(args, kwargs).get(name) is not None:
        return kwargs
    tokens = sequence_input(args, kwargs)
    positions = split.positions(tokens.shape[SEQUENCE_DIM], tokens.device)
    if name == "position_ids":
        positions = positions.unsqueeze(0).expand(tokens.shape[0], -1)
    return {**kwargs, name: positions}


def sequence_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The tokens ``[batch, seq]`` a model call is given: its first input."""
    tokens = args[0] if args else kwargs.get("input_ids", kwargs.get("tokens"))
    if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2:
        raise PlanError(
            "context_parallel finds the sequence length from the first positional input "
            f"(tokens [batch, seq]); got {type(tokens).__name__}"
        )
    return tokens


def hf_ring_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A ``transformers`` attention implementation: ring attention of the running step."""
    attend = sequence_attention()
    if attend is None:
        raise PlanError(
            f"attention implementation {HF_ATTENTION!r} runs only inside a context_parallel step"
        )
    if dropout:
        raise PlanError(
            f"{type(module).__name__} drops out attention probabilities in training "
            f"(dropout={dropout}), which context_parallel's ring attention does not do; build "
            "the model with its attention dropout at 0 (the config's attention_dropout, "
            "attn_pdrop or attention_probs_dropout_prob), or train without context_parallel"
        )
    check_attention_call(module, attention_mask, kwargs)
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    window = attention_window(module, kwargs.get("sliding_window"), sequence_length(query.shape[2]))
    sinks = kwargs.get("s_aux")  # GPT-OSS's attention sinks, one logit per head
    out = attend(query, key, value, causal=causal, scale=scaling, window=window, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def hf_config(module: nn.Module) -> Any:
    """The ``transformers`` config whose attention implementation to switch, or None."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return None
    from transformers import AttentionInterface

    if HF_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(HF_ATTENTION, hf_ring_attention)
    return config
