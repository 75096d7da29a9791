"""``Model.apply`` of one pipeline stage: its blocks only, from the activation it receives.

While a stage runs, the model's other blocks are swapped out of their ``nn.ModuleList`` for
:class:`_Skip` (passes its input on), and the modules outside blocks that belong to other
stages for stand-ins: one that runs before the blocks (the embedding) returns zeros shaped
like its real output (worked out on the meta device), which the stage's first block then
replaces by the received activation; one that runs after them (norm, head) must never be
reached, as a stage before the last stops after its last block (:class:`StageDone`).
Model code between those modules (masks, positions, rotary tables) runs on every stage, from
the batch every pipeline rank receives.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import tree
from ._pipeline_run import StageRun, current_stage_run
from .errors import PlanError

if TYPE_CHECKING:
    from ._plan import Plan

__all__ = ["running_root_slots", "stage_modules", "start_stage"]


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


def start_stage(model: Any, plan: Plan) -> StageRun:
    """The stage run that this ``apply`` belongs to; raises outside one, or on a second
    ``apply`` in one stage forward."""
    run = current_stage_run()
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
    return run


def running_root_slots(model: Any, plan: Plan, run: StageRun) -> tuple[Any, ...]:
    """The slots of params outside blocks whose modules run on this stage."""
    split = plan.pipeline.split
    running = set(split.before if run.first else ()) | set(split.after if run.last else ())
    paths = _module_paths(model, plan)
    return tuple(s for s in model._root_slots if paths[id(s.owner)] in running)


def _module_paths(model: Any, plan: Plan) -> dict[int, str]:
    key = ("module paths", id(model))
    found = plan.pipeline.cache.get(key)
    if found is None:
        found = {id(m): p for p, m in model.module.named_modules()}
        plan.pipeline.cache[key] = found
    return found


@contextmanager
def stage_modules(model: Any, plan: Plan, run: StageRun) -> Iterator[None]:
    """Swap in :class:`_Skip` for other stages' blocks and stand-ins for their modules."""
    split = plan.pipeline.split
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    for index, (_, parent, name) in enumerate(model._block_homes):
        if not run.start <= index < run.stop:
            swaps.append((parent, name, _Skip()))
    module = model.module
    if not run.first:
        for path in split.before:
            original = module.get_submodule(path)
            dtypes = _compute_dtypes(model, plan, path, original)
            swaps.append((*_home(module, path), _BeforeBlocks(original, path, run, dtypes)))
    if not run.last:
        swaps += [(*_home(module, path), _AfterBlocks(path)) for path in split.after]
    saved = []
    for parent, name, stand_in in swaps:
        saved.append(parent._modules[name])
        parent._modules[name] = stand_in
    try:
        yield
    finally:
        for (parent, name, _), original in zip(swaps, saved, strict=True):
            parent._modules[name] = original


def _home(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, name = path.rpartition(".")
    if not name:
        raise PlanError("pipeline cannot stand in for the root module itself")
    return module.get_submodule(parent), name


def _compute_dtypes(model: Any, plan: Plan, path: str, module: nn.Module) -> dict[str, torch.dtype]:
    """The dtypes the module's params compute in (``shard_params(param_dtype=...)``)."""
    out = {}
    for name in module._parameters:
        key = f"{path}.{name}"
        entry = plan.entries.get(model.tied.get(key, key))
        if entry is not None and entry.compute_dtype is not None:
            out[name] = entry.compute_dtype
    return out
