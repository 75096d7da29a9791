"""Applying a model whose params are placed on a mesh: gather per block, regather for backward.

``Model.apply`` under an active plan (inside a transformed step) swaps in, for each param, the
tensor its plan computes with (``Plan.materialize_many``: one gather of the stored shards for
all the params of a block, as FSDP2 gathers a unit). Params outside any block are gathered
when ``apply`` starts; a block's params (a child of an ``nn.ModuleList``) when the block's
forward starts, and the block's slots get the stored params back when it ends. With
``reshard_after_forward`` (eager only), saved-tensor hooks replace each gathered param that
autograd saves for the backward by a handle, and gather it again when the backward needs it,
so gathered params do not outlive their block. Under
``tensor_parallel`` the same hooks, and hooks on linears, embeddings and block children, move
activations between layouts (``_activations``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from . import _activations
from ._pipeline_run import StageDone, StageRun
from ._sequence_split import HF_ATTENTION, SequenceSplit, hf_config, with_positions
from ._stage_apply import running_root_slots, stage_modules, start_stage
from .errors import PlanError

if TYPE_CHECKING:
    from ._plan import Plan

__all__ = [
    "active_split",
    "apply_placed",
    "enter_block",
    "enter_module",
    "exit_block",
    "exit_module",
]


class _State(threading.local):
    """This thread's ``apply`` in progress; set up fresh in each thread, so that Dynamo's
    guard on it sees the same attributes on every call."""

    def __init__(self) -> None:
        self.frame: _Frame | None = None


_state = _State()


@dataclass
class _Frame:
    """One ``apply`` in progress on this thread."""

    model: Any
    params: Any
    plan: Plan
    regather: _Regather | None
    originals: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    sequence_sharded: bool = False
    stash: dict[str, Any] = field(default_factory=dict)
    stage: StageRun | None = None

    def materialize(self, slots: Any) -> list[torch.Tensor]:
        """The tensors to compute with for ``slots`` (tied aliases gathered once); a
        pipeline stage's params come gathered already."""
        keys = [self.model.tied.get(slot.key, slot.key) for slot in slots]
        if self.stage is not None:
            return [self.params[key] for key in keys]
        unique = list(dict.fromkeys(keys))
        locals_ = self.plan.materialize_many(unique, self.params)
        if self.regather is not None:
            self.regather.track(locals_)
        return [locals_[key] for key in keys]


@dataclass(frozen=True)
class _Handle:
    """A saved gathered param, replaced by the recipe to gather it again."""

    key: str
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _Regather:
    """Saved-tensor hooks that drop gathered params and gather them again in the backward."""

    def __init__(self, plan: Plan, params: Any) -> None:
        self.plan = plan
        self.params = params
        self.gathered: dict[int, tuple[str, weakref.ref]] = {}
        self.pending: dict[str, int] = {}
        self.cache: dict[str, torch.Tensor] = {}
        self.together: dict[str, tuple[str, ...]] = {}

    def track(self, gathered: dict[str, torch.Tensor]) -> None:
        """Remember params gathered together, to gather them again together."""
        for key, local in gathered.items():
            self.gathered[local.untyped_storage().data_ptr()] = (key, weakref.ref(local))
            self.together[key] = tuple(gathered)

    def pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, DTensor) or tensor.device.type == "meta":
            return tensor
        found = self.gathered.get(tensor.untyped_storage().data_ptr())
        if found is None or found[1]() is None:  # a dead entry's address may be reused
            return tensor
        key = found[0]
        self.pending[key] = self.pending.get(key, 0) + 1
        return _Handle(key, tensor.size(), tensor.stride(), tensor.storage_offset())

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        full = self.cache.get(packed.key)
        if full is None:
            # Gather again, in one go, every param gathered with this one that the backward
            # still needs (the embedding table, needed by nobody, is left out).
            wanted = [
                k
                for k in self.together[packed.key]
                if self.pending.get(k, 0) > 0 and k not in self.cache
            ]
            detached = {k: self.params[k].detach() for k in wanted}
            with torch.no_grad():
                self.cache.update(self.plan.materialize_many(wanted, detached))
            full = self.cache[packed.key]
        self.pending[packed.key] -= 1
        if not self.pending[packed.key]:
            del self.cache[packed.key]
        return full.as_strided(packed.size, packed.stride, packed.offset)


def apply_placed(model: Any, plan: Plan, params: Any, args: Any, kwargs: Any) -> Any:
    """``model.apply`` with params gathered per block (see the module docstring); under
    ``pipeline``, only the running stage's part of the model (``_stage_apply``)."""
    stage = start_stage(model, plan) if plan.pipeline is not None else None
    reshard = (
        plan.reshard_after_forward
        and plan.gathers
        and stage is None
        and not torch.compiler.is_compiling()
    )
    if plan.activations is not None:
        _activations.check_heads(model.module, plan.activations)
        _activations.check_modules(model, plan.entries, plan.activations)
    split = plan.sequence_split
    config = hf_config(model.module) if split is not None else None
    if split is not None:
        kwargs = with_positions(split, model._position_kwarg, args, kwargs)
    attention = config._attn_implementation if config is not None else None
    frame = _Frame(model, params, plan, _Regather(plan, params) if reshard else None, stage=stage)
    _activations.check_own_loss(frame, kwargs)
    root_slots = model._root_slots if stage is None else running_root_slots(model, plan, stage)
    saved = []
    for slot, local in zip(root_slots, frame.materialize(root_slots), strict=True):
        store = slot.store()
        saved.append(store[slot.name])
        store[slot.name] = local
    for slot in model._buffer_slots:
        store = slot.store()
        saved.append(store[slot.name])
        store[slot.name] = model.buffers[slot.key]
    previous = _state.frame
    _state.frame = frame
    try:
        if config is not None:
            config._attn_implementation = HF_ATTENTION
        if stage is not None:
            with stage_modules(model, plan, stage):
                return model.module(*args, **kwargs)
        if frame.regather is None:
            return model.module(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(frame.regather.pack, frame.regather.unpack):
            return model.module(*args, **kwargs)
    finally:
        _state.frame = previous
        if frame.stash:  # a forward raised between a module's pre-hook and its hook
            _activations.restore_modules(frame)
        if config is not None:
            config._attn_implementation = attention
        for slot, old in zip((*root_slots, *model._buffer_slots), saved, strict=True):
            slot.store()[slot.name] = old


def active_split() -> SequenceSplit | None:
    """How ``context_parallel`` splits sequences in the step running on this thread, or None.

    Attention code asks it: under a split, attend with ``split.attention(q, k, v)`` (ring
    attention over the whole sequence) rather than over the local shard.
    """
    frame = _state.frame
    return frame.plan.sequence_split if frame is not None else None


def _frame_of(model: Any) -> _Frame | None:
    frame = _state.frame
    return frame if frame is not None and frame.model is model else None


def enter_block(
    model: Any, index: int, module: nn.Module, args: Any, kwargs: Any
) -> tuple[Any, Any] | None:
    """Forward pre-hook of block ``index``: swap in its gathered params."""
    frame = _frame_of(model)
    if frame is None:
        return None
    slots = model._blocks[index][1]
    frame.originals[index] = [slot.store()[slot.name] for slot in slots]
    for slot, local in zip(slots, frame.materialize(slots), strict=True):
        slot.store()[slot.name] = local
    stage = frame.stage
    if stage is not None:
        stage.entered = True
        if index == stage.start and stage.input is not None:
            # The activation the previous stage sent, laid out as blocks pass it on.
            args, kwargs = _activations.replace_input(args, kwargs, "block", lambda _: stage.input)
            layout = frame.plan.activations
            frame.sequence_sharded = layout is not None and layout.sequence_parallel
            return args, kwargs  # already sequence-sharded: nothing for enter_block to slice
    return _activations.enter_block(frame, args, kwargs)


def exit_block(model: Any, index: int, module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of block ``index``: put the block's own tensors back."""
    frame = _frame_of(model)
    if frame is None:
        return
    for slot, old in zip(model._blocks[index][1], frame.originals.pop(index), strict=True):
        slot.store()[slot.name] = old
    stage = frame.stage
    if stage is not None and index == stage.stop - 1 and not stage.last:
        stage.output = output if isinstance(output, torch.Tensor) else output[0]
        raise StageDone


def enter_module(
    model: Any, path: str, module: nn.Module, args: Any, kwargs: Any
) -> tuple[Any, Any] | None:
    """Forward pre-hook of a linear, embedding, block child or owner of params outside blocks:
    tensor-parallel activation layouts."""
    frame = _frame_of(model)
    if frame is None or frame.plan.activations is None:
        return None
    layout = frame.plan.activations
    if layout.sequence_parallel and not frame.sequence_sharded:
        for key in model._root_owners.get(path, ()):
            if isinstance(frame.plan.entries[key].grad[layout.index], Partial):
                raise PlanError(
                    f"param {key!r} is used before the first block, where the sequence is "
                    f"whole on every {layout.axis!r} rank, but sequence parallelism sums its "
                    "grad over them; use tensor_parallel(..., sequence_parallel=False)"
                )
    return _activations.enter_module(frame, path, module, args, kwargs)


def exit_module(model: Any, path: str, module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook matching :func:`enter_module`."""
    frame = _frame_of(model)
    if frame is None or frame.plan.activations is None:
        return None
    return _activations.exit_module(frame, path, module, output)
