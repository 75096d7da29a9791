"""Laying params out, and gathering stored params for compute.

:func:`gather_params` is what a block runs when it starts: the params it uses, gathered from
their stored placement to their compute placement (one all-gather for all those sharded
alike, as FSDP2 gathers a unit). :func:`issue_gather` starts those all-gathers ahead of
their use without waiting (prefetch); ``gather_params(..., issued=...)`` then waits for them
instead of gathering. In the backward each grad, ``Partial`` on the data-parallel axes, is
reduced back to the stored placement (one reduce-scatter for those gathered together) by
``_grad_reduce``, unless the running step defers reductions (microbatch accumulation).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ._accumulated_dtype import accumulated_dtype
from ._codec_statistics import gathering_axes, shard_statistics, shard_values
from ._grad_reduce import deferring, nested, padded, reduce_many, reduce_to, scaled_grad, unreduced
from ._param_plan import ParamPlan
from ._plan import Plan

__all__ = [
    "IssuedGather",
    "coalescible",
    "distribute",
    "gather",
    "gather_many",
    "gather_params",
    "issue_gather",
    "local_like",
]

# The functional collective ops themselves (what DTensor issues, Dynamo traces and
# ``d9d.core._comm_count`` counts): their Python wrappers were renamed between torch 2.11 and 2.13.
_c10d = torch.ops._c10d_functional


def distribute(tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> DTensor:
    """``tensor`` as a DTensor laid out ``placements``: this rank keeps its own shard of the
    full tensor every rank passes, with no communication."""
    if isinstance(tensor, DTensor):
        return tensor.redistribute(mesh, placements)
    if tensor.is_meta:  # no values to split: torch.chunk into 1024 meta views took 3 ms a param
        local, _ = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
        return DTensor.from_local(
            tensor.new_empty(local),
            mesh,
            placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    return distribute_tensor(tensor.detach(), mesh, placements, src_data_rank=None)


def gather(stored: DTensor, mesh: DeviceMesh, entry: ParamPlan) -> Any:
    """``stored`` encoded by ``entry.codec`` and redistributed to ``entry.compute``, as a
    local tensor (or the codec's tuple of parts: ``Cast``'s doc).

    In the backward the local grad is taken as a DTensor laid out ``entry.grad`` (``Partial``
    on the data-parallel axes), cast to ``entry.reduce_dtype``, scaled by ``entry.grad_scale``
    and reduced to ``entry.grad_kept`` by :func:`reduce_to`; while accumulating microbatches
    it is returned unreduced.
    """
    return _Gather.apply(stored, mesh, entry)


def local_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local``, a shard computed from ``like``'s (same shape), as a DTensor laid out like
    ``like``: no check, no communication."""
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, stored: DTensor, mesh: DeviceMesh, entry: ParamPlan) -> torch.Tensor:
        ctx.mesh, ctx.entry = mesh, entry
        ctx.shape, ctx.stride, ctx.dtype = stored.shape, stored.stride(), stored.dtype
        ctx.defer = deferring()
        # Deferred, the grad is summed over microbatches first, in the accumulated dtype.
        ctx.reduce_dtype = (
            accumulated_dtype(entry) if ctx.defer else entry.reduce_dtype or entry.dtype
        )
        if entry.codec is None:
            compute = entry.dtype
            if stored.dtype != compute:  # a leaf widened for its sums (``_autodiff``)
                stored = local_like(stored.to_local().to(compute), stored)
            return stored.redistribute(mesh, entry.compute).to_local()
        local, statistic = stored.to_local(), None
        if entry.codec.statistic_op is not None:  # over the gathering axes (no cast has one:
            # a jitted step never looks a group up here)
            names = [mesh.get_group(i).group_name for i in gathering_axes(entry, mesh)]
            (statistic,) = shard_statistics([entry], [local], names, mesh)
        encoded = entry.codec.encode(local, shard_values(entry, mesh, statistic))
        stored = local_like(encoded, stored)
        gathered = stored.redistribute(mesh, entry.compute).to_local()
        decoded = entry.codec.decode(gathered, statistic)
        if isinstance(decoded, tuple):
            ctx.mark_non_differentiable(*decoded[1:])
        return decoded

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *carried: None) -> tuple[DTensor | None, ...]:
        del carried  # a codec's parts beside the decoded tensor: not differentiated
        entry = ctx.entry
        local = scaled_grad(grad.to(ctx.reduce_dtype), entry)
        out = DTensor.from_local(
            local, ctx.mesh, entry.grad, run_check=False, shape=ctx.shape, stride=ctx.stride
        )
        if not ctx.defer:
            out = reduce_to(out, entry.grad_kept).to(ctx.dtype)
        return out, None, None


@dataclass(frozen=True)
class IssuedGather:
    """The all-gathers :func:`gather_params` would run for ``paths``, issued and not waited for.

    Attributes:
        paths: The params they gather, in the order given to :func:`issue_gather`.
        buffers: ``{group key: all-gather output}`` per coalesced group; each output is valid
            only once waited for (``gather_params(..., issued=self)`` or :meth:`wait`).
        statistics: ``{group key: each param's all-reduced codec statistic}`` (None each
            for a cast), which decoding the buffer takes.
    """

    paths: tuple[str, ...]
    buffers: dict[tuple, torch.Tensor]
    statistics: dict[tuple, list[torch.Tensor | None]]

    def wait(self) -> None:
        """Wait for the all-gathers (to drop them unused)."""
        for buffer in self.buffers.values():
            _c10d.wait_tensor(buffer)


def _grouped(
    plan: Plan, paths: list[str], params: Mapping[str, Any]
) -> tuple[list[str], dict[tuple, list[str]]]:
    """``(alone, groups)``: the stored DTensors of ``paths`` that cannot share a collective,
    and ``{(axis, compute dtype, reduce dtype, grad placement): paths}`` of those gathered
    from ``Shard`` to ``Replicate`` over one mesh axis (a group of one takes a collective
    alone). Their codecs may differ: an fp8 weight shares its block's all-gather with the
    block's norms (``_flat_shards``)."""
    alone: list[str] = []
    groups: dict[tuple, list[str]] = {}
    for path in paths:
        if not isinstance(params[path], DTensor):
            continue
        e = plan.entries[path]
        found = coalescible(e)
        if found is None:
            alone.append(path)
            continue
        axis = found[0]
        key = (axis, e.compute_dtype or e.dtype, e.reduce_dtype or e.dtype, e.grad[axis])
        groups.setdefault(key, []).append(path)
    return alone, groups


def gather_params(
    plan: Plan,
    paths: list[str],
    params: Mapping[str, Any],
    issued: IssuedGather | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors to compute with for ``paths``: each stored DTensor gathered to its compute
    placement, with one collective per group of params gathered alike (one mesh axis, same
    dtypes and grad layout); a plain tensor is already in its compute layout (a pipeline
    stage's params, gathered once per step). With ``issued`` (from :func:`issue_gather` for
    the same ``paths`` and ``params``) the groups' all-gathers are waited for, not run."""
    alone, groups = _grouped(plan, paths, params)
    out = {p: params[p] for p in paths if not isinstance(params[p], DTensor)}
    for path in alone:
        out[path] = _gather_one(plan, plan.entries[path], params[path])
    for key, members in groups.items():
        if len(members) == 1:
            out[members[0]] = _gather_one(plan, plan.entries[members[0]], params[members[0]])
            continue
        stored = [params[p] for p in members]
        entries = [plan.entries[p] for p in members]
        buffer = None if issued is None else (issued.buffers[key], issued.statistics[key])
        gathered = gather_many(stored, plan.mesh, entries, key[0], plan.group_names, issued=buffer)
        out.update(zip(members, gathered, strict=True))
    return {p: out[p] for p in paths}


def issue_gather(plan: Plan, paths: list[str], params: Mapping[str, Any]) -> IssuedGather:
    """Start the all-gathers that ``gather_params(plan, paths, params)`` coalesces, without
    waiting for them, so they run while other work computes (prefetch). Params that take a
    collective alone are gathered when ``gather_params`` runs. The same bytes move either way.

    Every rank must issue the same gathers in the same order, as for any collective."""
    _, groups = _grouped(plan, paths, params)
    buffers, statistics = {}, {}
    with torch.no_grad():
        for key, members in groups.items():
            if len(members) == 1:
                continue
            axis, group = key[0], plan.group_names[key[0]]
            stored = [params[p] for p in members]
            entries = [plan.entries[p] for p in members]
            ranks = plan.mesh.shape[axis]
            statistics[key] = _statistics(stored, entries, _groups(group, ranks), plan.mesh)
            flat = _flat_shards(stored, entries, axis, ranks, statistics[key])
            buffers[key] = _all_gather(flat, ranks, group)
    return IssuedGather(tuple(paths), buffers, statistics)


def _all_gather(flat: torch.Tensor, ranks: int, group: str) -> torch.Tensor:
    """The all-gather of ``flat`` over ``ranks`` ranks of ``group``, not yet waited for; over
    one rank ``flat`` itself: no collective, as DTensor skips a one-rank mesh axis (a
    one-rank ``fsdp`` axis all-gathered every param and reduce-scattered every grad each
    step, counted in ``step.comms`` as bytes that never crossed a wire)."""
    return flat if ranks == 1 else _c10d.all_gather_into_tensor(flat, ranks, group)


def _groups(group: str, ranks: int) -> list[str]:
    """The process groups a statistic is all-reduced over for a gather over ``group`` of
    ``ranks`` ranks: none over one rank."""
    return [group] if ranks > 1 else []


def _statistics(
    stored: Sequence[DTensor], entries: Sequence[ParamPlan], groups: list[str], mesh: DeviceMesh
) -> list[torch.Tensor | None]:
    """:func:`shard_statistics` of a coalesced group's shards; None each, with no lookup,
    where no codec of the group has a statistic (casts: the common case)."""
    if not any(e.codec is not None and e.codec.statistic_op for e in entries):
        return [None] * len(entries)
    return shard_statistics(entries, [t.to_local() for t in stored], groups, mesh)


def _gather_one(plan: Plan, entry: ParamPlan, stored: DTensor) -> Any:
    return gather(stored, plan.mesh, entry)


def coalescible(entry: ParamPlan) -> tuple[int, int] | None:
    """``(mesh axis, tensor dim)`` when ``entry`` is gathered over exactly one mesh axis from a
    plain ``Shard(dim)`` to ``Replicate`` (so its gather can share one collective with others),
    else None."""
    differ = [
        i for i, (s, c) in enumerate(zip(entry.storage, entry.compute, strict=True)) if s != c
    ]
    if len(differ) != 1:
        return None
    axis = differ[0]
    stored, used = entry.storage[axis], entry.compute[axis]
    if not (isinstance(stored, Shard) and isinstance(used, Replicate)):
        return None
    if not isinstance(entry.grad[axis], Partial):
        return None
    return None if nested(entry.storage, axis, stored.dim) else (axis, stored.dim)


def gather_many(
    stored: list[DTensor],
    mesh: DeviceMesh,
    entries: list[ParamPlan],
    axis: int,
    groups: tuple[str, ...],
    *,
    issued: tuple[torch.Tensor, list[torch.Tensor | None]] | None = None,
) -> list[torch.Tensor]:
    """Like :func:`gather` for several params sharded over the same mesh ``axis``, with one
    all-gather for all of them (and one reduce-scatter of their grads in the backward, then
    one all-reduce per other axis over which all their grads are ``Partial`` and kept whole:
    HSDP's replicate axis, as FSDP2 reduces a param group).

    Each shard is padded to the largest shard's size along its sharded dim (as DTensor and
    FSDP2 lay uneven shards out), flattened and concatenated; the gathered buffer is cut
    back into params. Entries must share the compute dtype, reduce dtype and grad
    placements; their codecs may differ (the buffer is then bytes).
    ``groups`` are the names of the mesh axes' process groups (looked up once, outside any
    graph).
    ``issued``: the all-gather of these shards, already issued (:func:`issue_gather`), to
    wait for instead of gathering, and the codec statistics it was encoded with. A codec
    with a statistic (``Cast``'s doc) has its statistics all-reduced over ``axis`` in one
    collective for all the entries before the all-gather.
    """
    flat = _GatherMany.apply(mesh, axis, groups, tuple(entries), issued, *stored)
    out, start = [], 0
    for entry in entries:
        parts = _parts(entry)
        out.append(flat[start] if parts == 1 else tuple(flat[start : start + parts]))
        start += parts
    return out


def _parts(entry: ParamPlan) -> int:
    """How many tensors ``entry``'s gather returns (``Cast``'s doc: a codec's ``parts``)."""
    return 1 if entry.codec is None else entry.codec.parts


def _layouts(
    stored: list[DTensor], entries: list[ParamPlan], axis: int, ranks: int
) -> list[tuple[int, int, tuple[int, ...], int, tuple[int, ...]]]:
    """Per shard: ``(sharded dim, rows per rank padded, other dims, own rows, global stride)``."""
    layouts = []
    for tensor, entry in zip(stored, entries, strict=True):
        dim = entry.storage[axis].dim
        local = tensor.to_local().shape
        rest = (*local[:dim], *local[dim + 1 :])
        chunk = -(-entry.shape[dim] // ranks)
        layouts.append((dim, chunk, rest, local[dim], tensor.stride()))
    return layouts


def _wire(entry: ParamPlan) -> torch.dtype:
    """The dtype ``entry``'s shard is all-gathered in: its own without a codec (which has no
    compute dtype of its own then), else the codec's."""
    return entry.dtype if entry.codec is None else entry.codec.wire_dtype


def _piece_sizes(entries: Sequence[ParamPlan], numels: Sequence[int]) -> tuple[bool, list[int]]:
    """``(in bytes, sizes)``: whether the group's all-gather moves bytes (its wire dtypes
    differ: fp8 weights beside bfloat16 norms), and each shard's size in the buffer, in
    elements or, in bytes, rounded up to the widest wire dtype's size (so each piece views
    back as its dtype)."""
    wires = [_wire(e) for e in entries]
    if len(set(wires)) == 1:
        return False, list(numels)
    align = max(w.itemsize for w in wires)
    return True, [-(-n * w.itemsize // align) * align for n, w in zip(numels, wires, strict=True)]


def _flat_shards(
    stored: list[DTensor],
    entries: list[ParamPlan],
    axis: int,
    ranks: int,
    statistics: list[torch.Tensor | None],
) -> torch.Tensor:
    """The all-gather input: each shard encoded by its codec with its all-reduced statistic
    (no codec: in the param's dtype), its sharded dim moved first and padded to the largest
    shard's rows, flattened and concatenated; as bytes where the wire dtypes differ, each
    piece padded to :func:`_piece_sizes`' size."""
    pieces = []
    for tensor, entry, statistic in zip(stored, entries, statistics, strict=True):
        dim = entry.storage[axis].dim
        local = tensor.to_local()
        codec = entry.codec
        encoded = (
            local.to(entry.dtype)
            if codec is None
            else codec.encode(local, shard_values(entry, tensor.device_mesh, statistic))
        )
        rows = encoded.movedim(dim, 0)
        pieces.append(padded(rows, -(-entry.shape[dim] // ranks)).reshape(-1))
    in_bytes, sizes = _piece_sizes(entries, [p.numel() for p in pieces])
    if in_bytes:
        pieces = [
            padded(p.contiguous().view(torch.uint8), size)
            for p, size in zip(pieces, sizes, strict=True)
        ]
    return torch.cat(pieces)


class _GatherMany(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        mesh: DeviceMesh,
        axis: int,
        groups: tuple[str, ...],
        entries: tuple,
        issued: tuple[torch.Tensor, list[torch.Tensor | None]] | None,
        *stored: DTensor,
    ) -> Any:
        ranks = mesh.shape[axis]
        layouts = _layouts(list(stored), list(entries), axis, ranks)
        group = groups[axis]
        ctx.mesh, ctx.axis, ctx.groups, ctx.entries, ctx.layouts = (
            mesh,
            axis,
            groups,
            entries,
            layouts,
        )
        ctx.dtypes = [t.dtype for t in stored]
        ctx.defer = deferring()
        if issued is None:
            statistics = _statistics(stored, entries, _groups(group, ranks), mesh)
            flat = _flat_shards(list(stored), list(entries), axis, ranks, statistics)
            buffer = _all_gather(flat, ranks, group)
        else:
            buffer, statistics = issued
        gathered = _c10d.wait_tensor(buffer).view(ranks, -1)
        numels = [chunk * math.prod(rest) for _, chunk, rest, _, _ in layouts]
        in_bytes, sizes = _piece_sizes(entries, numels)
        outs, offset = [], 0
        for entry, (dim, chunk, rest, _, _), statistic, numel, size in zip(
            entries, layouts, statistics, numels, sizes, strict=True
        ):
            part = gathered[:, offset : offset + size]
            if in_bytes:
                wire = _wire(entry)
                part = part[:, : numel * wire.itemsize].view(wire)
            part = part.reshape(ranks * chunk, *rest)
            out = part[: entry.shape[dim]].movedim(0, dim)
            # `part` is a view of the buffer (no copy) with one rank, one param or one row
            # per rank; an output still viewing it then gets its own storage: the regather
            # hooks key saved tensors on their storage and offset, and regather a subset of
            # the params into another buffer (a param of one row, as Qwen2-MoE's
            # shared_expert_gate [1, H], read another's elements).
            viewed = ranks == 1 or len(entries) == 1 or chunk == 1
            # Not a no-op .contiguous(): torch 2.11's Dynamo gives the traced backward zero
            # grads for an output that a no-op .contiguous() (or .to) returned.
            if not out.is_contiguous():
                out = out.contiguous()
            elif viewed:
                out = out.clone()
            decoded = out if entry.codec is None else entry.codec.decode(out, statistic)
            if isinstance(decoded, tuple):
                ctx.mark_non_differentiable(*decoded[1:])
                outs.extend(decoded)
            else:
                outs.append(decoded)
            offset += size
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *flat: torch.Tensor) -> tuple[Any, ...]:
        entries, strides = ctx.entries, [layout[4] for layout in ctx.layouts]
        # Each param's grad: the first of its parts' (the others are not differentiated).
        grads, start = [], 0
        for entry in entries:
            grads.append(flat[start])
            start += _parts(entry)
        if ctx.defer:
            return (None,) * 5 + tuple(unreduced(list(grads), ctx.mesh, entries, strides))
        kept = [e.storage[ctx.axis] for e in entries]
        mine = [layout[3] for layout in ctx.layouts]
        reduced = reduce_many(
            list(grads), ctx.mesh, entries, ctx.axis, ctx.groups, kept, mine, strides
        )
        return (None,) * 5 + tuple(g.to(d) for g, d in zip(reduced, ctx.dtypes, strict=True))
