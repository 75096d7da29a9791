"""Applying a model whose params are placed on a mesh: gather per block, regather for backward.

``Model.apply`` under an active plan (inside a transformed step) swaps in, for each param, the
tensor its plan computes with (``Plan.materialize``: a gather of the stored shards). Params
outside any block are gathered when ``apply`` starts; a block's params (a child of an
``nn.ModuleList``) when the block's forward starts, and the block's slots get the stored
params back when it ends. With ``reshard_after_forward`` (eager only), saved-tensor hooks
replace each gathered param that autograd saves for the backward by a handle, and gather it
again when the backward needs it, so gathered params do not outlive their block.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from ._plan import Plan

__all__ = ["apply_placed", "enter_block", "exit_block"]


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

    def materialize(self, key: str) -> torch.Tensor:
        local = self.plan.materialize(key, self.params[key])
        if self.regather is not None:
            self.regather.track(key, self.params[key], local)
        return local


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

    def track(self, key: str, stored: DTensor, local: torch.Tensor) -> None:
        self.gathered[local.untyped_storage().data_ptr()] = (key, weakref.ref(local))

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
            with torch.no_grad():
                full = self.plan.materialize(packed.key, self.params[packed.key].detach())
            self.cache[packed.key] = full
        self.pending[packed.key] -= 1
        if not self.pending[packed.key]:
            del self.cache[packed.key]
        return full.as_strided(packed.size, packed.stride, packed.offset)


def apply_placed(model: Any, plan: Plan, params: Any, args: Any, kwargs: Any) -> Any:
    """``model.apply`` with params gathered per block (see the module docstring)."""
    reshard = plan.reshard_after_forward and not torch.compiler.is_compiling()
    frame = _Frame(model, params, plan, _Regather(plan, params) if reshard else None)
    saved = []
    for slot in model._root_slots:
        store = slot.store()
        saved.append(store[slot.name])
        store[slot.name] = frame.materialize(model.tied.get(slot.key, slot.key))
    for slot in model._buffer_slots:
        store = slot.store()
        saved.append(store[slot.name])
        store[slot.name] = model.buffers[slot.key]
    previous = _state.frame
    _state.frame = frame
    try:
        if frame.regather is None:
            return model.module(*args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(frame.regather.pack, frame.regather.unpack):
            return model.module(*args, **kwargs)
    finally:
        _state.frame = previous
        for slot, old in zip((*model._root_slots, *model._buffer_slots), saved, strict=True):
            slot.store()[slot.name] = old


def enter_block(model: Any, index: int, module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook of block ``index``: swap in its gathered params."""
    frame = _state.frame
    if frame is None or frame.model is not model:
        return
    slots = model._blocks[index][1]
    frame.originals[index] = [slot.store()[slot.name] for slot in slots]
    for slot in slots:
        slot.store()[slot.name] = frame.materialize(model.tied.get(slot.key, slot.key))


def exit_block(model: Any, index: int, module: torch.nn.Module, args: Any, output: Any) -> None:
    """Forward hook of block ``index``: put the block's own tensors back."""
    frame = _state.frame
    if frame is None or frame.model is not model:
        return
    for slot, old in zip(model._blocks[index][1], frame.originals.pop(index), strict=True):
        slot.store()[slot.name] = old
