"""ZeRO-1/2's boundary in one block: whole params in, their grads reduced together out.

A block's ZeRO params compute with their whole stored tensors (no all-gather), and in the
backward their grads are reduced in one collective over the sharding axis, as FSDP reduces a
unit: one reduce-scatter of their padded rows (ZeRO-2: each rank keeps the rows of its
shard) or one all-reduce (ZeRO-1: each rank keeps the whole grad and the step body reads
its shard's slice of it), then one all-reduce per other axis over which all their grads
are averaged and kept whole (HSDP's replicate axis).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ...core._collectives import local_like, reduce_to
from ...core._context import current
from ...core._param_plan import ParamPlan

__all__ = ["gather_wholes"]

_c10d = torch.ops._c10d_functional


def gather_wholes(
    views: list[DTensor],
    wholes: list[DTensor],
    entries: list[ParamPlan],
    axis: int,
    groups: tuple[str, ...],
) -> list[torch.Tensor]:
    """The local tensors to compute with, from ``wholes`` (the stored params that ``views``,
    the step body's slices, are cut from). In the backward the grads go to ``views``, reduced
    over mesh ``axis`` in one collective (``entries`` share the axis, its grad placement, the
    reduce dtype, and whether the grad is kept sharded), unless the step defers reductions
    (microbatch accumulation): then each is returned ``Partial``, reduced once per step.
    ``groups``: the mesh axes' process group names."""
    return list(_GatherWholes.apply(axis, groups, tuple(entries), len(views), *views, *wholes))


def _padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    if rows.shape[0] == count:
        return rows
    out = rows.new_zeros((count, *rows.shape[1:]))
    out[: rows.shape[0]] = rows
    return out


def _all_reduced(flat: torch.Tensor, op: str, size: int, group: str) -> torch.Tensor:
    flat = _c10d.wait_tensor(_c10d.all_reduce(flat, "sum", group))
    return flat / size if op == "avg" else flat


class _GatherWholes(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        axis: int,
        groups: tuple[str, ...],
        entries: tuple[ParamPlan, ...],
        count: int,
        *tensors: DTensor,
    ) -> Any:
        views, wholes = tensors[:count], tensors[count:]
        first, mesh = entries[0], wholes[0].device_mesh
        ctx.axis, ctx.groups, ctx.entries, ctx.mesh = axis, groups, entries, mesh
        ctx.shapes = [w.shape for w in wholes]
        ctx.strides = [w.stride() for w in wholes]
        ctx.dtypes = [w.dtype for w in wholes]
        ctx.mine = [v.to_local().shape for v in views]
        ctx.reduce_dtype = first.reduce_dtype or wholes[0].dtype
        step = current()
        ctx.defer = step is not None and step.defer_reduction
        ctx.over = tuple(
            i
            for i, p in enumerate(first.grad)
            if i != axis
            and isinstance(p, Partial)
            and all(e.grad[i] == p and isinstance(e.grad_kept[i], Replicate) for e in entries)
        )
        outs = []
        for whole, entry in zip(wholes, entries, strict=True):
            if entry.codec is not None:
                whole = local_like(entry.codec.encode(whole.to_local()), whole)
            if tuple(whole.placements) != entry.compute:
                whole = whole.redistribute(mesh, entry.compute)
            local = whole.to_local()
            # A new tensor object: autograd gives the output a grad_fn, not the stored param.
            outs.append(local.detach() if entry.codec is None else entry.codec.decode(local))
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        entries, mesh, axis = ctx.entries, ctx.mesh, ctx.axis
        scaled = [
            g.to(ctx.reduce_dtype) * e.grad_scale if e.grad_scale != 1 else g.to(ctx.reduce_dtype)
            for g, e in zip(grads, entries, strict=True)
        ]
        none = (None,) * (4 + len(grads))
        if ctx.defer:  # summed over microbatches, reduced once (``value_and_grad``)
            return (
                None,
                None,
                None,
                None,
                *(
                    DTensor.from_local(g, mesh, e.grad, run_check=False, shape=s, stride=t)
                    for g, e, s, t in zip(scaled, entries, ctx.shapes, ctx.strides, strict=True)
                ),
                *none[4:],
            )
        if isinstance(entries[0].grad_kept[axis], Shard):
            locals_ = _reduce_scattered(ctx, scaled)
        else:
            flat = torch.cat([g.reshape(-1) for g in scaled])
            flat = _all_reduced(flat, entries[0].grad[axis].reduce_op, *_group(ctx, axis))
            flat = _over_others(ctx, flat)
            sizes = [g.numel() for g in scaled]
            locals_ = [
                part.view(g.shape) for part, g in zip(torch.split(flat, sizes), scaled, strict=True)
            ]
        out = []
        for local, entry, shape, stride, dtype in zip(
            locals_, entries, ctx.shapes, ctx.strides, ctx.dtypes, strict=True
        ):
            placements = tuple(
                entry.grad_kept[i] if i == axis else Replicate() if i in ctx.over else p
                for i, p in enumerate(entry.grad)
            )
            grad = DTensor.from_local(
                local.contiguous(), mesh, placements, run_check=False, shape=shape, stride=stride
            )
            grad = reduce_to(grad, entry.grad_kept)
            if tuple(grad.placements) != entry.state_kept:  # ZeRO-1: this rank's slice
                grad = grad.redistribute(mesh, entry.state_kept)
            out.append(grad.to(dtype))
        return (None, None, None, None, *out, *none[4:])


def _group(ctx: Any, axis: int) -> tuple[int, str]:
    return ctx.mesh.shape[axis], ctx.groups[axis]


def _over_others(ctx: Any, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` all-reduced over the other axes its grads are averaged and kept whole on."""
    for other in ctx.over:
        flat = _all_reduced(flat, ctx.entries[0].grad[other].reduce_op, *_group(ctx, other))
    return flat


def _reduce_scattered(ctx: Any, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's rows of each grad, summed (or averaged) over the axis in one
    reduce-scatter: each grad's sharded dim moved first and padded to ``ranks`` equal
    chunks, as DTensor lays uneven shards out."""
    ranks, group = _group(ctx, ctx.axis)
    layouts, pieces = [], []
    for grad, entry, mine in zip(grads, ctx.entries, ctx.mine, strict=True):
        dim = entry.grad_kept[ctx.axis].dim
        rows = grad.movedim(dim, 0)
        chunk = -(-rows.shape[0] // ranks)
        layouts.append((dim, chunk, rows.shape[1:], mine[dim]))
        pieces.append(_padded(rows, ranks * chunk).reshape(ranks, -1))
    flat = torch.cat(pieces, dim=1).reshape(-1)
    reduced = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(flat, "sum", ranks, group))
    if ctx.entries[0].grad[ctx.axis].reduce_op == "avg":
        reduced = reduced / ranks
    reduced = _over_others(ctx, reduced)
    out, offset = [], 0
    for dim, chunk, rest, mine in layouts:
        size = chunk * math.prod(rest)
        out.append(reduced[offset : offset + size].view(chunk, *rest)[:mine].movedim(0, dim))
        offset += size
    return out
