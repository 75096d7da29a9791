"""The collectives of a plan: gathering stored params for compute, reducing grads to storage.

:func:`gather_params` is what a block runs when it starts: the params it uses, gathered from
their stored placement to their compute placement (one all-gather for all those sharded
alike, as FSDP2 gathers a unit). In the backward each grad, ``Partial`` on the data-parallel
axes, is reduced back to the stored placement (one reduce-scatter for those gathered
together), unless the running step defers reductions (microbatch accumulation).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ._context import current
from ._plan import ParamPlan, Plan

__all__ = ["distribute", "gather", "gather_many", "gather_params", "local_like", "reduce_to"]

# The functional collective ops themselves (what DTensor issues, Dynamo traces and
# ``d9d._comms`` counts): their Python wrappers were renamed between torch 2.11 and 2.13.
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


def gather(
    stored: DTensor,
    mesh: DeviceMesh,
    compute: tuple[Placement, ...],
    grad: tuple[Placement, ...],
    *,
    compute_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``stored`` cast to ``compute_dtype`` and redistributed to ``compute``, as a local tensor.

    In the backward the local grad is taken as a DTensor laid out ``grad`` (``Partial`` on
    the data-parallel axes), cast to ``reduce_dtype`` and reduced to the stored placement by
    :func:`reduce_to`; while accumulating microbatches it is returned unreduced.
    """
    return _Gather.apply(stored, mesh, compute, grad, compute_dtype, reduce_dtype)


def reduce_to(grad: DTensor, placements: tuple[Placement, ...]) -> DTensor:
    """``grad`` redistributed to ``placements``, over the sharded axes first.

    Reduce-scattering before all-reducing moves ``1/n`` of the bytes over the replicated
    axes; DTensor left alone all-reduces the whole grad first (HSDP: 2x the bytes).
    """
    for want_shard in (True, False):
        current = list(grad.placements)
        for i, target in enumerate(placements):
            if isinstance(target, Shard) == want_shard and current[i] != target:
                current[i] = target
        if tuple(current) != tuple(grad.placements):
            grad = grad.redistribute(grad.device_mesh, current)
    return grad


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
    def forward(
        ctx: Any,
        stored: DTensor,
        mesh: DeviceMesh,
        compute: tuple[Placement, ...],
        grad: tuple[Placement, ...],
        compute_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        ctx.mesh, ctx.grad, ctx.storage = mesh, grad, tuple(stored.placements)
        ctx.shape, ctx.stride, ctx.dtype = stored.shape, stored.stride(), stored.dtype
        ctx.reduce_dtype, ctx.defer = reduce_dtype or stored.dtype, _deferring()
        if compute_dtype is not None:
            stored = stored.to(compute_dtype)
        return stored.redistribute(mesh, compute).to_local()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor | None, ...]:
        local = grad.to(ctx.reduce_dtype)
        out = DTensor.from_local(
            local, ctx.mesh, ctx.grad, run_check=False, shape=ctx.shape, stride=ctx.stride
        )
        if not ctx.defer:
            out = reduce_to(out, ctx.storage).to(ctx.dtype)
        return out, None, None, None, None, None


def gather_params(
    plan: Plan, paths: list[str], params: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """The tensors to compute with for ``paths``: each stored DTensor gathered to its compute
    placement, with one collective per group of params gathered alike (one mesh axis, same
    dtypes and grad layout); a plain tensor is already in its compute layout (a pipeline
    stage's params, gathered once per step)."""
    groups: dict[tuple, list[str]] = {}
    out: dict[str, torch.Tensor] = {}
    for path in paths:
        stored = params[path]
        if not isinstance(stored, DTensor):
            out[path] = stored
            continue
        e = plan.entries[path]
        found = coalescible(e)
        if found is None:
            out[path] = _gather_one(plan, e, stored)
            continue
        axis = found[0]
        key = (axis, e.compute_dtype or e.dtype, e.reduce_dtype or e.dtype, e.grad[axis])
        groups.setdefault(key, []).append(path)
    for (axis, *_), members in groups.items():
        if len(members) == 1:
            out[members[0]] = _gather_one(plan, plan.entries[members[0]], params[members[0]])
            continue
        stored = [params[p] for p in members]
        entries = [plan.entries[p] for p in members]
        gathered = gather_many(stored, plan.mesh, entries, axis, plan.group_names[axis])
        out.update(zip(members, gathered, strict=True))
    return {p: out[p] for p in paths}


def _gather_one(plan: Plan, entry: ParamPlan, stored: DTensor) -> torch.Tensor:
    return gather(
        stored,
        plan.mesh,
        entry.compute,
        entry.grad,
        compute_dtype=entry.compute_dtype,
        reduce_dtype=entry.reduce_dtype,
    )


def _deferring() -> bool:
    step = current()
    return step is not None and step.defer_reduction


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
    dim = stored.dim
    nested = any(isinstance(p, Shard) and p.dim == dim for p in _others(entry.storage, axis))
    return None if nested else (axis, dim)


def _others(placements: tuple[Placement, ...], axis: int) -> tuple[Placement, ...]:
    return (*placements[:axis], *placements[axis + 1 :])


def gather_many(
    stored: list[DTensor], mesh: DeviceMesh, entries: list[ParamPlan], axis: int, group: str
) -> list[torch.Tensor]:
    """Like :func:`gather` for several params sharded over the same mesh ``axis``, with one
    all-gather for all of them (and one reduce-scatter of their grads in the backward).

    Each shard is padded to the largest shard's size along its sharded dim (as DTensor and
    FSDP2 lay uneven shards out), flattened and concatenated; the gathered buffer is cut
    back into params. Entries must share the compute dtype, reduce dtype and grad placements.
    ``group`` is the name of the axis's process group (looked up once, outside any graph).
    """
    return list(_GatherMany.apply(mesh, axis, group, tuple(entries), *stored))


def _padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    if rows.shape[0] == count:
        return rows
    out = rows.new_zeros((count, *rows.shape[1:]))
    out[: rows.shape[0]] = rows
    return out


class _GatherMany(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, mesh: DeviceMesh, axis: int, group: str, entries: tuple, *stored: DTensor
    ) -> Any:
        ranks = mesh.shape[axis]
        first = entries[0]
        dtype = first.compute_dtype or stored[0].dtype
        layouts, pieces = [], []
        for tensor, entry in zip(stored, entries, strict=True):
            dim = entry.storage[axis].dim
            rows = tensor.to_local().to(dtype).movedim(dim, 0)
            chunk = -(-entry.shape[dim] // ranks)
            layouts.append((dim, chunk, tuple(rows.shape[1:]), rows.shape[0], tensor.stride()))
            pieces.append(_padded(rows, chunk).reshape(-1))
        ctx.mesh, ctx.axis, ctx.group, ctx.entries, ctx.layouts = (
            mesh,
            axis,
            group,
            entries,
            layouts,
        )
        ctx.dtypes = [t.dtype for t in stored]
        ctx.reduce_dtype = first.reduce_dtype or stored[0].dtype
        ctx.defer = _deferring()
        gathered = _c10d.wait_tensor(
            _c10d.all_gather_into_tensor(torch.cat(pieces), ranks, group)
        ).view(ranks, -1)
        outs, offset = [], 0
        for entry, (dim, chunk, rest, _, _) in zip(entries, layouts, strict=True):
            size = chunk * math.prod(rest)
            part = gathered[:, offset : offset + size].reshape(ranks * chunk, *rest)
            out = part[: entry.shape[dim]].movedim(0, dim)
            # Not a no-op .contiguous(): torch 2.11's Dynamo gives the traced backward zero
            # grads for an output that a no-op .contiguous() (or .to) returned.
            out = out if out.is_contiguous() else out.contiguous()
            if ranks == 1 or len(entries) == 1:
                out = out.clone()  # a view of the buffer: the regather hooks key on storages
            outs.append(out)
            offset += size
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        mesh, axis, entries = ctx.mesh, ctx.axis, ctx.entries
        if ctx.defer:
            return (
                None,
                None,
                None,
                None,
                *(
                    DTensor.from_local(
                        g.to(ctx.reduce_dtype),
                        mesh,
                        e.grad,
                        run_check=False,
                        shape=torch.Size(e.shape),
                        stride=layout[4],
                    )
                    for g, e, layout in zip(grads, entries, ctx.layouts, strict=True)
                ),
            )
        ranks, group = mesh.shape[axis], ctx.group
        pieces = []
        for grad, (dim, chunk, _, _, _) in zip(grads, ctx.layouts, strict=True):
            rows = _padded(grad.to(ctx.reduce_dtype).movedim(dim, 0), ranks * chunk)
            pieces.append(rows.reshape(ranks, -1))
        flat = torch.cat(pieces, dim=1).reshape(-1)
        reduced = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(flat, "sum", ranks, group))
        if entries[0].grad[axis].reduce_op == "avg":
            reduced = reduced / ranks
        out, offset = [], 0
        for entry, dtype, (dim, chunk, rest, mine, stride) in zip(
            entries, ctx.dtypes, ctx.layouts, strict=True
        ):
            size = chunk * math.prod(rest)
            local = reduced[offset : offset + size].view(chunk, *rest)[:mine].movedim(0, dim)
            offset += size
            placements = tuple(
                entry.storage[i] if i == axis else p for i, p in enumerate(entry.grad)
            )
            grad = DTensor.from_local(
                local.contiguous(),
                mesh,
                placements,
                run_check=False,
                shape=torch.Size(entry.shape),
                stride=stride,
            )
            out.append(reduce_to(grad, entry.storage).to(dtype))
        return (None, None, None, None, *out)
