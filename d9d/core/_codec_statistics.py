"""A gather codec's statistics (``Cast``'s doc in ``_param_plan.py``): the all-reduced values,
such as the amax of an fp8 weight, that ``encode`` and ``decode`` take beside the shard.

A statistic is reduced over the axes the param is gathered over, one collective per op and
group for all the params that have one; with a ``statistic_dim`` each rank lays its shard's
values at its offset among the gathered tensor's indices first (:func:`shard_values` reads
a shard's back). A step takes them once before its first gather
(:func:`codec_statistics`); a gather outside a step reduces its own
(:func:`shard_statistics`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ._context import current
from ._param_plan import ParamPlan
from ._plan import Plan
from ._shard_rows import shard_rows

__all__ = ["codec_statistics", "gathering_axes", "shard_statistics", "shard_values"]

_c10d = torch.ops._c10d_functional


def gathering_axes(entry: ParamPlan, mesh: DeviceMesh) -> list[int]:
    """The mesh axes ``entry`` is gathered over (stored and computed laid out differently),
    but those of one rank, where nothing is gathered."""
    # mesh.size(i), not mesh.shape: torch 2.11's Dynamo cannot iterate a traced mesh's shape.
    pairs = enumerate(zip(entry.storage, entry.compute, strict=True))
    return [i for i, (stored, used) in pairs if stored != used and mesh.size(i) > 1]


# What a rank that holds no value of an index gives to the all-reduce of a statistic.
_IDENTITY = {"max": -math.inf, "sum": 0.0}


def _indices(entry: ParamPlan, mesh: DeviceMesh, placements: tuple) -> tuple[int, int]:
    """``(first, count)``: the indices of dim ``entry.codec.statistic_dim`` that a rank
    holds of ``entry``'s param laid out ``placements``: each mesh axis that shards the dim
    cuts what the axes before it left into chunks of ``ceil(rows / ranks)`` (DTensor's
    layout). Plain integers from the mesh coordinate: DTensor's own
    ``compute_local_shape_and_global_offset`` computes offsets as tensors, which under
    ``torch.compile`` become unbacked symbols."""
    dim, coordinate = entry.codec.statistic_dim, mesh.get_coordinate()
    first, count = 0, entry.shape[dim]
    for axis, placement in enumerate(placements):
        if isinstance(placement, Shard) and placement.dim == dim:
            start, count = shard_rows(count, mesh.shape[axis], coordinate[axis])
            first += start
    return first, count


def _laid_out(entry: ParamPlan, mesh: DeviceMesh, values: torch.Tensor) -> torch.Tensor:
    """A shard's statistic as the gathered tensor's: unchanged without ``statistic_dim``;
    with it, the shard's values at its offset among the gathered tensor's indices, the op's
    identity elsewhere (``Cast``'s doc), so that the all-reduce combines values of one
    index only."""
    if entry.codec.statistic_dim is None:
        return values
    first, count = _indices(entry, mesh, entry.storage)
    start, total = _indices(entry, mesh, entry.compute)
    if values.numel() != count:
        raise ValueError(
            f"{entry.path}: its gather codec's statistic has {values.numel()} values for a "
            f"shard of {count} indices of dim {entry.codec.statistic_dim}: one per index"
        )
    before, after = first - start, total - count - (first - start)
    if before == after == 0:
        return values
    fill = _IDENTITY[entry.codec.statistic_op]
    return torch.cat([values.new_full((before,), fill), values, values.new_full((after,), fill)])


def shard_values(
    entry: ParamPlan, mesh: DeviceMesh, statistic: torch.Tensor | None
) -> torch.Tensor | None:
    """What ``encode`` takes of the all-reduced ``statistic``: the shard's indices of its
    ``statistic_dim`` (all of it without one)."""
    if statistic is None or entry.codec.statistic_dim is None:
        return statistic
    first, count = _indices(entry, mesh, entry.storage)
    start, _ = _indices(entry, mesh, entry.compute)
    return statistic[first - start : first - start + count]


def _reduced_statistics(
    entries: Sequence[ParamPlan],
    shards: Sequence[torch.Tensor],
    groups: Sequence[str],
    mesh: DeviceMesh,
) -> list[torch.Tensor]:
    """Each shard's ``codec.statistic`` (laid out as the gathered tensor's:
    :func:`_laid_out`), all-reduced with the codecs' one ``statistic_op`` over the process
    ``groups``: one collective per group for all of them."""
    own = [
        _laid_out(e, mesh, e.codec.statistic(shard).float().reshape(-1))
        for e, shard in zip(entries, shards, strict=True)
    ]
    flat = torch.cat(own)
    for group in groups:
        flat = _c10d.wait_tensor(_c10d.all_reduce(flat, entries[0].codec.statistic_op, group))
    return list(flat.split([s.numel() for s in own]))


def codec_statistics(plan: Plan, params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``{path: all-reduced codec statistic}`` of every stored param in ``params`` whose codec
    has one (``Cast``'s doc): one all-reduce per op and gathering axes for all of them.

    A statistic depends only on the stored shard, which does not change within a step, so a
    step takes them once, before its first gather (``StepContext.codec_statistics``), not
    once per gather: a unit's forward gather, its regather for the backward, and each
    microbatch's would each all-reduce the same values.
    """
    found: dict[tuple, list[str]] = {}
    for path, stored in params.items():
        entry = plan.entries.get(path)
        if entry is None or entry.codec is None or entry.codec.statistic_op is None:
            continue
        if not isinstance(stored, DTensor):
            continue
        groups = tuple(plan.group_names[i] for i in gathering_axes(entry, plan.mesh))
        found.setdefault((entry.codec.statistic_op, groups), []).append(path)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for (_, groups), paths in found.items():
            entries = [plan.entries[p] for p in paths]
            shards = [params[p].to_local() for p in paths]
            reduced = _reduced_statistics(entries, shards, groups, plan.mesh)
            out.update(zip(paths, reduced, strict=True))
    return out


def shard_statistics(
    entries: Sequence[ParamPlan], shards: list[torch.Tensor], groups: list[str], mesh: DeviceMesh
) -> list[torch.Tensor | None]:
    """Each shard's all-reduced codec statistic (None for a shard with no codec or a codec
    without statistic: a cast): the running step's (:func:`codec_statistics`), else
    all-reduced here over the process ``groups`` (the gathering axes), one collective per
    group and op for all of them."""
    out: list[torch.Tensor | None] = [None] * len(shards)
    step = current()
    known = {} if step is None or step.codec_statistics is None else step.codec_statistics
    wanted = [i for i, e in enumerate(entries) if e.codec is not None and e.codec.statistic_op]
    for i in [i for i in wanted if entries[i].path in known]:
        out[i] = known[entries[i].path]
    missing = [i for i in wanted if out[i] is None]
    for op in dict.fromkeys(entries[i].codec.statistic_op for i in missing):
        members = [i for i in missing if entries[i].codec.statistic_op == op]
        reduced = _reduced_statistics(
            [entries[i] for i in members], [shards[i] for i in members], groups, mesh
        )
        for i, value in zip(members, reduced, strict=True):
            out[i] = value
    return out
