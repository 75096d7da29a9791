"""``Model.apply`` of one pipeline stage: its blocks only, from the activation it receives.

While a stage runs, the model's other blocks are swapped out of their ``nn.ModuleList`` for
:class:`_Skip` (passes its input on), and the modules outside blocks that belong to other
stages for stand-ins: one that runs before the blocks (the embedding) returns zeros shaped
like its real output (worked out on the meta device), which the stage's first block then
replaces by the received activation; one that runs after them (norm, head) must never be
reached, as a stage before the last stops after its last block (:class:`StageDone`).
Model code between those modules (masks, positions, rotary tables) runs on every stage, from
the batch every pipeline rank receives.

A block whose first argument is a tuple carries a state (``d9d.models.moe.MoEState``: the
residual stream and running statistics) and returns one alike: the stage sends every tensor
of its last block's state, and the next stage rebuilds it, in the structure its own first
block receives, from the tensors it got.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ... import tree
from ..._plan import Plan
from ..._runtime import ApplyCall, Interception, replace_activation
from ...errors import PlanError
from ._executor import PipelineLayout, StageDone, StageRun

__all__ = ["enter_stage"]


class _Skip(nn.Module):
    """A block of another stage: returns its activation input unchanged."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs["hidden_states"]


class _BeforeBlocks(nn.Module):
    """A module of the first stage, on a later stage: zeros shaped like its output."""

    def __init__(self, original: nn.Module, path: str, run: StageRun, dtypes: dict) -> None:
        super().__init__()
        # Not registered as a child: the stand-in must hold no params of its own.
        self.__dict__["original"] = original
        self.path, self.run, self.dtypes = path, run, dtypes

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.run.entered:
            raise PlanError(
                f"module {self.path!r} is registered before the model's blocks, so pipeline "
                "runs it on the first stage only, but it was called after a block; register "
                "it after the blocks"
            )
        original = self.original
        saved = dict(original._parameters)
        device = next(
            (x.device for x in tree.leaves((args, kwargs)) if isinstance(x, torch.Tensor)), None
        )
        try:
            for name, tensor in saved.items():
                if tensor is not None:
                    original._parameters[name] = torch.empty(
                        tensor.shape, dtype=self.dtypes.get(name, tensor.dtype), device="meta"
                    )
            meta_args, meta_kwargs = tree.map(_to_meta, (args, kwargs))
            out = type(original).forward(original, *meta_args, **meta_kwargs)
        finally:
            original._parameters.update(saved)
        return tree.map(
            lambda x: (
                torch.zeros(x.shape, dtype=x.dtype, device=device)
                if isinstance(x, torch.Tensor)
                else x
            ),
            out,
        )


def _to_meta(x: Any) -> Any:
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x


class _AfterBlocks(nn.Module):
    """A module of the last stage, on an earlier stage: must not run."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PlanError(
            f"module {self.path!r} is registered after the model's blocks, so pipeline runs it "
            "on the last stage only, but it was called before the blocks ended; register it "
            "before the blocks"
        )


def enter_stage(layout: PipelineLayout, call: ApplyCall) -> None:
    """Set ``call`` up to run only the running stage: other stages' blocks skipped, modules
    outside blocks of other stages stood in for, the stage's first block fed the received
    activation and its last block ending the forward (unless it is the last stage)."""
    run = layout.run
    if run is None:
        raise PlanError(
            "under pipeline, model.apply runs only inside d9d.value_and_grad (which runs the "
            "stages); compute every use of the model inside the differentiated loss function"
        )
    if run.applied:
        raise PlanError(
            "under pipeline the loss function may call model.apply once per microbatch; "
            "fold other uses of the model into that call"
        )
    run.applied = True
    split, structure = layout.split, call.structure
    for block in structure.blocks:
        if not run.start <= block.index < run.stop:
            call.stand_in(block.path, _Skip())
            continue
        enter = functools.partial(_enter_block, run, block.index)
        exit_ = functools.partial(_exit_block, run) if block.index == run.stop - 1 else None
        call.intercept(block.path, Interception(enter=enter, exit=exit_))
    modules = structure.modules
    if not run.first:
        for path in split.before:
            dtypes = _compute_dtypes(structure.tied, call.plan, path, modules[path])
            call.stand_in(path, _BeforeBlocks(modules[path], path, run, dtypes))
    if not run.last:
        for path in split.after:
            call.stand_in(path, _AfterBlocks(path))


def _enter_block(run: StageRun, index: int, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    run.entered = True
    run.carried = bool(args) and isinstance(args[0], tuple)
    if index != run.start or run.input is None:
        return None
    if run.carried:
        # A carried state: the previous stage sent its leaves, in the order flatten gives.
        spec = tree.structure(args[0])
        if spec.num_leaves != len(run.input):
            raise PlanError(
                f"block {index} takes a state of {spec.num_leaves} tensors but the stage before "
                f"sent {len(run.input)}; a block taking a tuple must return one alike"
            )
        return (tree.unflatten(spec, list(run.input)), *args[1:]), kwargs
    # The activation the previous stage sent, laid out as blocks pass it on.
    return replace_activation(args, kwargs, "block", lambda _: run.input[0])


def _exit_block(run: StageRun, output: Any) -> None:
    if run.last:
        return
    if run.carried:
        run.output = tuple(tree.leaves(output))
    else:
        run.output = output if isinstance(output, torch.Tensor) else output[0]
    raise StageDone


def _compute_dtypes(
    tied: dict[str, str], plan: Plan, path: str, module: nn.Module
) -> dict[str, torch.dtype]:
    """The dtypes the module's params compute in (``shard_params(param_dtype=...)``)."""
    out = {}
    for name in module._parameters:
        key = f"{path}.{name}"
        entry = plan.entries.get(tied.get(key, key))
        if entry is not None and entry.compute_dtype is not None:
            out[name] = entry.compute_dtype
    return out
