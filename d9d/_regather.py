"""Dropping gathered params after the forward and gathering them again for the backward.

Autograd saves the gathered copy of a param that a matmul uses, which would keep every
block's gathered params alive until the backward. Under a plan whose params say
``regather``, saved-tensor hooks replace each saved gathered param by a handle, and the
backward gathers it again (with the params gathered together with it, in one collective)
when it needs it, as FSDP2 reshards after forward. Eager only: under ``torch.compile`` the
compiler decides what to save.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ._collectives import gather_params
from ._plan import Plan

__all__ = ["Regather"]


@dataclass(frozen=True)
class _Handle:
    """A saved gathered param, replaced by the recipe to gather it again."""

    key: str
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class Regather:
    """Saved-tensor hooks (:meth:`pack`, :meth:`unpack`) that drop gathered params and gather
    them again in the backward."""

    def __init__(self, plan: Plan, params: Any) -> None:
        self.plan = plan
        self.params = params
        self.gathered: dict[int, tuple[str, weakref.ref]] = {}
        self.pending: dict[str, int] = {}
        self.cache: dict[str, torch.Tensor] = {}
        self.together: dict[str, tuple[str, ...]] = {}

    def track(self, gathered: dict[str, torch.Tensor]) -> None:
        """Remember params gathered together whose plan says ``regather``, to gather them
        again together."""
        kept = {
            k: v
            for k, v in gathered.items()
            if self.plan.entries[k].regather and isinstance(self.params[k], DTensor)
        }
        for key, local in kept.items():
            self.gathered[local.untyped_storage().data_ptr()] = (key, weakref.ref(local))
            self.together[key] = tuple(kept)

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
                self.cache.update(gather_params(self.plan, wanted, detached))
            full = self.cache[packed.key]
        self.pending[packed.key] -= 1
        if not self.pending[packed.key]:
            del self.cache[packed.key]
        return full.as_strided(packed.size, packed.stride, packed.offset)
