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
from ...core._plan import Plan
from ...core._runtime import ApplyCall, Interception, replace_activation
from ...core._structure import Block
from ...errors import PlanError
from ._layout import PipelineLayout, StageDone, StageRun

__all__ = ["enter_stage"]


class _StandIn(nn.Module):
    """A stand-in that model code may read attributes of as of the module it stands in for
    (NemotronH reads each block's ``block_type``, Llama-4 its embedding's
    ``weight.device``): an attribute the stand-in lacks is the original's. The original is
    not registered as a child: the stand-in holds no params of its own."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.__dict__["original"] = original

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["original"], name)


class _Skip(_StandIn):
    """A block of another stage: returns its activation input unchanged."""

    def __init__(self, original: nn.Module, run: StageRun, block: Block) -> None:
        super().__init__(original)
        self.run, self.block = run, block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        _visit(self.run, self.block)
        return args[0] if args else kwargs["hidden_states"]


def _visit(run: StageRun, block: Block) -> None:
    """Check that the forward reaches the blocks once each, in order (each stage checks the
    blocks it runs and those it skips)."""
    if run.done:
        return
    if block.index <= run.visited:
        raise PlanError(
            f"the model runs block {block.path!r} again after block {run.visited} in one "
            "forward (a recurrent or looped model, as Dory's or HRM's): pipeline cuts the "
            "forward between blocks run once each, in order; use another layout for it"
        )
    run.visited = block.index


def _check_outside(run: StageRun, path: str, before: bool, count: int) -> None:
    """Check that a module outside the blocks runs on its side of them: a module the stage
    runs for real may not run between two blocks (its output would skip the stage's
    boundary: Dory's norm between its looped blocks)."""
    if run.done:
        return
    if (run.visited >= 0) if before else (run.visited < count - 1):
        raise PlanError(
            f"module {path!r} runs between the model's blocks (after block {run.visited}), "
            f"but pipeline runs it {'before' if before else 'after'} them, on the "
            f"{'first' if before else 'last'} stage only; a model that calls modules outside "
            "its blocks between them cannot be cut into stages: use another layout for it"
        )


class _BeforeBlocks(_StandIn):
    """A module of the first stage, on a later stage: zeros shaped like its output."""

    def __init__(self, original: nn.Module, path: str, run: StageRun, dtypes: dict) -> None:
        super().__init__(original)
        self.path, self.run, self.dtypes = path, run, dtypes

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.run.entered:
            raise PlanError(
                f"module {self.path!r} is registered before the model's blocks, so pipeline "
                "runs it on the first stage only, but it was called after a block; register "
                "it after the blocks"
            )
        original = self.__dict__["original"]
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


class _AfterBlocks(_StandIn):
    """A module of the last stage, on an earlier stage: must not run."""

    def __init__(self, original: nn.Module, path: str) -> None:
        super().__init__(original)
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
            "stages); compute every use of the model inside the differentiated loss function. "
            "A forward-only step (an eval step, no value_and_grad) has no pipeline schedule "
            "in d9d yet: run it under a layout without pipeline (the params restored there "
            "from a checkpoint)"
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
            call.stand_in(block.path, _Skip(structure.modules[block.path], run, block))
            continue
        enter = functools.partial(_enter_block, run, block)
        exit_ = functools.partial(_exit_block, run, block, block.index == run.stop - 1)
        call.intercept(block.path, Interception(enter=enter, exit=exit_))
    modules = structure.modules
    if not run.first:
        for path in split.before:
            dtypes = _compute_dtypes(structure.tied, call.plan, path, modules[path])
            call.stand_in(path, _BeforeBlocks(modules[path], path, run, dtypes))
    if not run.last:
        for path in split.after:
            call.stand_in(path, _AfterBlocks(modules[path], path))
    count = len(structure.blocks)
    for path, before, own in (
        *((p, True, run.first) for p in split.before),
        *((p, False, run.last) for p in split.after),
    ):
        if own:
            check = functools.partial(_check_outside, run, path, before, count)
            call.intercept(path, Interception(enter=lambda args, kwargs, c=check: c()))


def _enter_block(run: StageRun, block: Block, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    _visit(run, block)
    index = block.index
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


def _exit_block(run: StageRun, block: Block, ends_stage: bool, output: Any) -> None:
    if not run.carried:
        _check_one_tensor(run.stage, block, output)
    if run.last or not ends_stage:
        return
    if run.carried:
        run.output = tuple(tree.leaves(output))
    else:
        run.output = output if isinstance(output, torch.Tensor) else output[0]
    raise StageDone


def _check_one_tensor(stage: int, block: Block, output: Any) -> None:
    """Raise for a block that takes an activation and returns more tensors than it: the
    stage passes on only the first, and a stage skips other stages' blocks by passing their
    input on, so the others (an aux loss the model sums over its blocks) of the blocks on
    other stages would never reach the loss (the model crashed unpacking a skipped block's
    tensor, or summed its rows)."""
    if isinstance(output, torch.Tensor):
        return
    tensors = [x for x in tree.leaves(output) if isinstance(x, torch.Tensor)]
    if len(tensors) > 1:
        raise PlanError(
            f"pipeline stage {stage}: block {block.path!r} takes one activation but returns {len(tensors)} tensors "
            f"(a {type(output).__name__}), and pipeline passes only a block's activation "
            "between stages: the others of blocks on other stages (an aux loss summed over the "
            "blocks) would never reach this one; return the activation alone, or make the "
            "blocks take and return a tuple state that carries the others (as "
            "d9d.models.moe.MoEState carries the aux loss)"
        )


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
