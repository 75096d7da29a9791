"""ZeRO-1 and ZeRO-2 at run time: the update runs on shards of params stored whole.

[Note: the step body of a ZeRO-1/2 step] A param is stored whole over the sharding axis
and its optimizer state is kept ``Shard(dim)``. The step body sees each param as its
optimizer state is laid out: this rank's slice of the stored param, a view of it (no
communication, no copy: :meth:`Zero.enter_step`), except for a param whose kept dim another
axis shards too (a 1-D bias under tensor_parallel): DTensor splits nested shards over the
mesh's axes in order, fsdp's first, so its slice is one all-gather over that axis. The
user's unchanged ``grads -> opt.update -> apply_updates`` runs on shards, writing new ones
(``apply_updates`` is out of place): the caller's stored params stay as they were. The
forward computes with the whole stored param (no all-gather); its grad comes back to the
slice, reduce-scattered (ZeRO-2) or all-reduced and then sliced (ZeRO-1), one collective per
block (:mod:`._zero_reduce`; a nested param's alone, by DTensor). When the body returns, the
updated shards are all-gathered into whole params, one collective per mesh axis and dtype
for the whole model (:meth:`Zero.exit_step`). Under ``pipeline`` a stage gathers once per
step (``Runtime.gather_once``): :meth:`Zero.gather` hands it the whole stored params of all
its blocks, and the grads the microbatches accumulate are reduced in one collective. Under
``d9d.jit`` all of it is traced into
the step's one graph: a block tells the body's slices from other tensors by identity
(``StepContext.differentiated``), which Dynamo traces, and reads layouts from the plan, not
from its inputs' placements, which Dynamo guards by identity.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from ...core._context import current
from ...core._gather import coalescible, gather_many, gather_params
from ...core._grad_reduce import reducible
from ...core._param_plan import ParamPlan
from ...core._plan import Plan
from ...core._shard_rows import shard_rows
from ...errors import PlanError
from ._zero_reduce import gather_wholes

__all__ = ["Zero", "updates_sharded"]


def updates_sharded(entry: ParamPlan) -> bool:
    """Whether ``entry``'s update runs on a shard of the param it stores (ZeRO-1/2)."""
    return entry.state_kept != entry.storage


class Zero:
    """One step's slices of the params ZeRO-1/2 store whole, and their gathers back."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        # In the plan's order, the same on every rank: it orders the gathers' buffers (a
        # set's order follows the process's string hash seed, which differs between ranks).
        self.paths = tuple(p for p in plan.held if updates_sharded(plan.entries[p]))
        # {path: (slice the body sees, whole stored param)} while a step runs.
        self.wholes: dict[str, tuple[DTensor, DTensor]] = {}

    def enter_step(self, params: Any) -> Any:
        """``params`` (stored) with each ZeRO param replaced by its slice as its state is
        laid out, a view of the stored tensor, but for a param whose kept dim another axis
        shards too (see the module's note)."""
        out = dict(params)
        self.wholes = {}
        for path in self.paths:
            whole = params[path]
            view = _slice_of(whole, self.plan.entries[path])
            self.wholes[path] = (view, whole)
            out[path] = view
        return out

    def exit_step(self, params: Any) -> Any:
        """``params`` (as the body returned them) with each ZeRO param all-gathered whole:
        one all-gather per mesh axis and dtype; a slice returned as the body was given it
        (an eval step's) is its stored param again, with no communication."""
        wholes, self.wholes = self.wholes, {}
        out = dict(params)
        groups: dict[tuple[int, torch.dtype], list[str]] = {}
        for path in self.paths:
            leaf, entry = _returned(params, path, self.plan.entries[path]), self.plan.entries[path]
            if path in wholes and leaf is wholes[path][0]:
                out[path] = wholes[path][1]
                continue
            if tuple(leaf.placements) == entry.storage:
                continue
            back = _gathered_back(entry)
            found = coalescible(back)
            if tuple(leaf.placements) != entry.state_kept or found is None:
                out[path] = leaf.redistribute(leaf.device_mesh, entry.storage)
                continue
            groups.setdefault((found[0], leaf.dtype), []).append(path)
        plan = self.plan
        with torch.no_grad():
            for (axis, _), members in groups.items():
                entries = [_gathered_back(plan.entries[p]) for p in members]
                stored = [params[p] for p in members]
                locals_ = gather_many(stored, plan.mesh, entries, axis, plan.group_names)
                for path, local, entry, shard in zip(
                    members, locals_, entries, stored, strict=True
                ):
                    out[path] = DTensor.from_local(
                        local,
                        plan.mesh,
                        entry.compute,
                        run_check=False,
                        shape=shard.shape,
                        stride=shard.stride(),
                    )
        return out

    def gather(self, paths: list[str], params: Any) -> dict[str, torch.Tensor]:
        """The compute tensors of ``paths``: the slices this step's body was given compute
        with their whole stored params (no communication; their grads reduced together,
        :func:`gather_wholes`, each alone where it cannot share the collective); others are
        gathered from what they are."""
        out, rest = {}, []
        groups: dict[tuple, list[str]] = {}
        for path in paths:
            pair = self.wholes.get(path)
            if pair is None or not _same_tensor(params[path], pair[0]):
                rest.append(path)
                continue
            e = self.plan.entries[path]
            axis = _sharding_axis(e)
            if not reducible(e, axis, e.grad_kept[axis]):
                groups[(None, path)] = [path]
                continue
            kept = isinstance(e.grad_kept[axis], Shard)
            key = (axis, e.grad[axis], e.reduce_dtype or e.dtype, kept)
            groups.setdefault(key, []).append(path)
        for (axis, *_), members in groups.items():
            views = [params[p] for p in members]
            wholes = [self.wholes[p][1] for p in members]
            entries = [self.plan.entries[p] for p in members]
            gathered = gather_wholes(views, wholes, entries, axis, self.plan.group_names)
            out.update(zip(members, gathered, strict=True))
        if rest:
            out.update(gather_params(self.plan, rest, params))
        return {p: out[p] for p in paths}


def _returned(params: Any, path: str, entry: ParamPlan) -> DTensor:
    """The param the step body returned at ``path``, which must be a DTensor."""
    if path not in params:
        placements = ", ".join(map(repr, entry.state_kept))
        raise PlanError(
            f"the step body returned no param {path!r}; under shard_params(shard='grads' | "
            f"'opt_state') return every param it was given, {path!r} as a DTensor laid out "
            f"({placements}) (apply_updates keeps that layout)"
        )
    leaf = params[path]
    if not isinstance(leaf, DTensor):
        placements = ", ".join(map(repr, entry.state_kept))
        raise PlanError(
            f"the step body returned param {path!r} as a {type(leaf).__name__}; under "
            f"shard_params(shard='grads' | 'opt_state') return it as a DTensor laid out "
            f"({placements}), as the body was given it (apply_updates keeps that layout)"
        )
    return leaf


def _slice_of(whole: DTensor, entry: ParamPlan) -> DTensor:
    """This rank's slice of ``whole`` laid out as ``entry`` keeps its optimizer state: a view
    of the stored tensor where the slice is part of it, so the step holds no copy of it;
    else (its kept dim sharded by another axis too) one all-gather by DTensor."""
    axis = _sharding_axis(entry)
    kept = entry.state_kept[axis]
    if not isinstance(kept, Shard):
        raise PlanError(f"ZeRO keeps the optimizer state Shard(dim) on its axis, not {kept}")
    if any(isinstance(p, Shard) and p.dim == kept.dim for p in entry.storage):
        return whole.redistribute(whole.device_mesh, entry.state_kept)
    mesh, local, dim = whole.device_mesh, whole.to_local(), kept.dim
    start, count = shard_rows(local.shape[dim], mesh.size(axis), mesh.get_local_rank(axis))
    view = local.narrow(dim, start, count)
    return DTensor.from_local(
        view,
        mesh,
        entry.state_kept,
        run_check=False,
        shape=whole.shape,
        stride=whole.stride(),
    )


def _sharding_axis(entry: ParamPlan) -> int:
    """The mesh axis over which ``entry``'s optimizer state is sharded and its param not."""
    return next(
        i for i, (s, t) in enumerate(zip(entry.storage, entry.state_kept, strict=True)) if s != t
    )


def _gathered_back(entry: ParamPlan) -> ParamPlan:
    """``entry`` as :func:`gather_many` reads it to gather an updated slice whole."""
    return replace(entry, storage=entry.state_kept, compute=entry.storage, codec=None)


def _same_tensor(leaf: Any, view: DTensor) -> bool:
    """``leaf`` is ``view`` or the autograd leaf ``value_and_grad`` made of it (a detached
    alias; ``StepContext.differentiated``): told by identity, which Dynamo traces, where a
    comparison of data pointers breaks its graph."""
    if leaf is view:
        return True
    step = current()
    return step is not None and any(
        made is leaf and given is view for given, made in step.differentiated
    )
