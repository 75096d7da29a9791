"""ZeRO-1/2's boundary in one block: whole params in, their grads reduced together out.

A block's ZeRO params compute with their whole stored tensors (no all-gather), and in the
backward their grads are reduced by the core's :func:`~d9d.core._grad_reduce.reduce_many`,
in one collective over the sharding axis, as FSDP reduces a unit: one reduce-scatter of
their padded rows (ZeRO-2: each rank keeps the rows of its shard) or one all-reduce (ZeRO-1:
each rank keeps the whole grad and the step body reads its shard's slice of it), then one
all-reduce per other axis over which all their grads are averaged and kept whole (HSDP's
replicate axis). A grad that cannot share that collective (its kept dim also sharded by
another axis: tensor_parallel's 1-D biases) is reduced alone by DTensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ...core._context import current
from ...core._gather import local_like
from ...core._grad_reduce import reduce_many, reduce_to, unreduced
from ...core._param_plan import ParamPlan

__all__ = ["gather_wholes"]


def gather_wholes(
    views: list[DTensor],
    wholes: list[DTensor],
    entries: list[ParamPlan],
    axis: int | None,
    groups: tuple[str, ...],
) -> list[torch.Tensor]:
    """The local tensors to compute with, from ``wholes`` (the stored params that ``views``,
    the step body's slices, are cut from). In the backward the grads go to ``views``, reduced
    over mesh ``axis`` in one collective (``entries`` share the axis, its grad placement, the
    reduce dtype, and whether the grad is kept sharded; :func:`reduce_many`), or with
    ``axis=None`` (one entry that cannot share it) by DTensor, unless the step defers
    reductions (microbatch accumulation): then each is returned ``Partial``, reduced once per
    step. ``groups``: the mesh axes' process group names."""
    return list(_GatherWholes.apply(axis, groups, tuple(entries), len(views), *views, *wholes))


class _GatherWholes(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        axis: int | None,
        groups: tuple[str, ...],
        entries: tuple[ParamPlan, ...],
        count: int,
        *tensors: DTensor,
    ) -> Any:
        views, wholes = tensors[:count], tensors[count:]
        mesh = wholes[0].device_mesh
        ctx.axis, ctx.groups, ctx.entries, ctx.mesh = axis, groups, entries, mesh
        ctx.strides = [w.stride() for w in wholes]
        # The views' own: a view widened for sums beyond one backward (``_summed_wider``)
        # takes its reduced grad in the reduce dtype, not rounded to the stored one.
        ctx.dtypes = [v.dtype for v in views]
        ctx.mine = [
            v.to_local().shape[e.grad_kept[axis].dim]
            if axis is not None and e.grad_kept[axis].is_shard()
            else 0
            for v, e in zip(views, entries, strict=True)
        ]
        step = current()
        ctx.defer = step is not None and step.defer_reduction
        outs = []
        for whole, entry in zip(wholes, entries, strict=True):
            if entry.codec is not None:
                whole = local_like(entry.codec.encode(whole.to_local()), whole)
            # The plan's layouts, not the input's placements: under d9d.jit those are
            # guarded by identity, and a param the step returned holds equal new objects.
            if entry.storage != entry.compute:
                whole = whole.redistribute(mesh, entry.compute)
            local = whole.to_local()
            # A new tensor object: autograd gives the output a grad_fn, not the stored param.
            outs.append(local.detach() if entry.codec is None else entry.codec.decode(local))
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        entries, mesh, axis = ctx.entries, ctx.mesh, ctx.axis
        none = (None,) * (4 + len(grads))
        if ctx.defer:  # summed over microbatches, reduced once (``value_and_grad``)
            return (*none[:4], *unreduced(list(grads), mesh, entries, ctx.strides), *none[4:])
        if axis is None:
            reduced = [
                reduce_to(g, e.grad_kept)
                for g, e in zip(
                    unreduced(list(grads), mesh, entries, ctx.strides), entries, strict=True
                )
            ]
        else:
            kept = [e.grad_kept[axis] for e in entries]
            reduced = reduce_many(
                list(grads), mesh, entries, axis, ctx.groups, kept, ctx.mine, ctx.strides
            )
        out = []
        for grad, entry, dtype in zip(reduced, entries, ctx.dtypes, strict=True):
            if tuple(grad.placements) != entry.state_kept:  # ZeRO-1: this rank's slice
                grad = grad.redistribute(mesh, entry.state_kept)
            out.append(grad.to(dtype))
        return (*none[:4], *out, *none[4:])
