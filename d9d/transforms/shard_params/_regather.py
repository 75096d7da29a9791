"""Dropping gathered params after the forward and gathering them again for the backward.

Autograd saves the gathered copy of a param that a matmul uses, which would keep every
block's gathered params alive until the backward. Under a plan whose params say
``regather``, saved-tensor hooks replace each saved gathered param by a handle, and the
backward gathers it again (with the params gathered together with it, in one collective)
when it needs it, as FSDP2 reshards after forward. Eager only: Dynamo traces no saved-tensor
hooks, and under ``d9d.jit`` the runtime's graph pass does the same (:mod:`._regather_graph`).

Backward prefetch: units (params gathered together) are ordered by their last use in the
forward (the last tensor of theirs saved), which is the reverse of the order in which the
backward needs them. When one is gathered again, the all-gather of the unit before it in
that order is issued at once, if that unit's params say ``prefetch`` and it still has saved
tensors to give back, so it runs while this unit's backward computes; the next regather waits
for it. At most one is issued ahead. A unit with nothing saved (a block ``remat`` recomputes)
stops the chain: its recomputation gathers for itself.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ...core._gather import IssuedGather, gather_params, issue_gather
from ...core._plan import Plan

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

    def __init__(
        self, plan: Plan, params: Any, again: frozenset[str], early: frozenset[str]
    ) -> None:
        """``again``, ``early``: paths of the params whose schedule says ``regather``, and
        ``prefetch``."""
        self.plan = plan
        self.again = again
        self.early = early
        self.params = params
        self.gathered: dict[int, tuple[str, weakref.ref]] = {}
        self.pending: dict[str, int] = {}
        self.cache: dict[str, torch.Tensor] = {}
        self.together: dict[str, tuple[str, ...]] = {}
        # Units by last use in the forward (dict order), the one gather issued ahead.
        self.order: dict[tuple[str, ...], None] = {}
        self.issued: IssuedGather | None = None
        self.forward = True

    def close(self) -> None:
        """End of the forward: the order of units is final (a recomputation in the backward
        does not change it)."""
        self.forward = False

    def _used(self, unit: tuple[str, ...]) -> None:
        if self.forward:
            self.order.pop(unit, None)
            self.order[unit] = None

    def track(self, gathered: dict[str, torch.Tensor]) -> None:
        """Remember params gathered together whose plan says ``regather``, to gather them
        again together."""
        kept = {
            k: v
            for k, v in gathered.items()
            if k in self.again and isinstance(self.params[k], DTensor)
        }
        for key, local in kept.items():
            self.gathered[_storage_key(local)] = (key, weakref.ref(local))
            self.together[key] = tuple(kept)
        if kept:
            self._used(tuple(kept))

    def pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, DTensor):
            return tensor
        found = self.gathered.get(_storage_key(tensor))
        if found is None or found[1]() is None:  # a dead entry's address may be reused
            return tensor
        key = found[0]
        self.pending[key] = self.pending.get(key, 0) + 1
        self._used(self.together[key])
        return _Handle(key, tensor.size(), tensor.stride(), tensor.storage_offset())

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        full = self.cache.get(packed.key)
        if full is None:
            # Gather again, in one go, every param gathered with this one that the backward
            # still needs (the embedding table, needed by nobody, is left out).
            unit = self.together[packed.key]
            wanted = self._wanted(unit)
            detached = {k: self.params[k].detach() for k in wanted}
            with torch.no_grad():
                self.cache.update(gather_params(self.plan, wanted, detached, self._take(wanted)))
            self._issue_before(unit)
            full = self.cache[packed.key]
        self.pending[packed.key] -= 1
        if not self.pending[packed.key]:
            del self.cache[packed.key]
        return full.as_strided(packed.size, packed.stride, packed.offset)

    def _wanted(self, unit: tuple[str, ...]) -> list[str]:
        """The params of ``unit`` that the backward still needs and that are not gathered."""
        return [k for k in unit if self.pending.get(k, 0) > 0 and k not in self.cache]

    def _take(self, wanted: list[str]) -> IssuedGather | None:
        """The gather issued ahead for ``wanted``, if it was (then no longer held here)."""
        if self.issued is None or self.issued.paths != tuple(wanted):
            return None
        issued, self.issued = self.issued, None
        return issued

    def _issue_before(self, unit: tuple[str, ...]) -> None:
        """Issue the gather of the unit the backward needs after ``unit``: the one used just
        before it in the forward, if it prefetches and still has saved tensors."""
        if self.issued is not None:
            return
        units = list(self.order)
        at = units.index(unit) if unit in self.order else 0
        if at == 0:
            return
        wanted = self._wanted(units[at - 1])
        if wanted and all(k in self.early for k in wanted):
            detached = {k: self.params[k].detach() for k in wanted}
            self.issued = issue_gather(self.plan, wanted, detached)


def _storage_key(tensor: torch.Tensor) -> int:
    """Which storage ``tensor`` views: its address, or on meta (no data, every address 0:
    a dry run, as ``d9d plan``'s) the storage object's."""
    storage = tensor.untyped_storage()
    return storage._cdata if tensor.is_meta else storage.data_ptr()
