"""Reducing grads back to where the plan keeps them.

A grad comes out of a block ``Partial`` on the data-parallel axes (each rank's grad of its
own batch). :func:`reduce_many` reduces the grads of params gathered together in one
collective over the gathering axis (a reduce-scatter to their shards, or an all-reduce),
then one all-reduce per other axis over which all of them are ``Partial`` and kept whole
(HSDP's replicate axis), as FSDP2 reduces a param group; :func:`reduce_to` redistributes
one grad, sharded axes first. While the running step defers reductions (microbatch
accumulation, :func:`deferring`) grads are returned :func:`unreduced`, for the step to
reduce once. The gathers whose backward calls these are in ``_gather``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from ._accumulated_dtype import accumulated_dtype
from ._context import current
from ._param_plan import ParamPlan

__all__ = [
    "deferring",
    "nested",
    "padded",
    "reduce_many",
    "reduce_to",
    "reducible",
    "scaled_grad",
    "unreduced",
]

# The functional collective ops themselves (what DTensor issues, Dynamo traces and
# ``d9d.core._comm_count`` counts): their Python wrappers were renamed between torch 2.11 and 2.13.
_c10d = torch.ops._c10d_functional


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


def scaled_grad(grad: torch.Tensor, entry: ParamPlan) -> torch.Tensor:
    """``grad`` times ``entry.grad_scale`` (itself when 1)."""
    return grad if entry.grad_scale == 1 else grad * entry.grad_scale


def deferring() -> bool:
    """Whether the running step defers its grads' reductions (microbatch accumulation)."""
    step = current()
    return step is not None and step.defer_reduction


def reducible(entry: ParamPlan, axis: int, kept: Placement) -> bool:
    """Whether ``entry``'s grad can share :func:`reduce_many`'s collective over mesh ``axis``
    to ``kept``: a ``Replicate`` (all-reduced) or a ``Shard(dim)`` of a dim that no other
    axis shards (DTensor splits nested shards over the mesh's axes in order, not as rows of
    the local grad)."""
    return not isinstance(kept, Shard) or not nested(entry.grad, axis, kept.dim)


def nested(placements: tuple[Placement, ...], axis: int, dim: int) -> bool:
    """Whether an axis other than ``axis`` shards ``dim``."""
    others = (*placements[:axis], *placements[axis + 1 :])
    return any(isinstance(p, Shard) and p.dim == dim for p in others)


def _reduced_together(entries: tuple[ParamPlan, ...], axis: int) -> tuple[int, ...]:
    """The mesh axes other than ``axis`` over which every entry's grad is ``Partial`` (with
    one reduce op) and kept ``Replicate``: their grads can share one all-reduce per axis."""
    first = entries[0]
    return tuple(
        i
        for i, p in enumerate(first.grad)
        if i != axis
        and isinstance(p, Partial)
        and all(e.grad[i] == p and isinstance(e.grad_kept[i], Replicate) for e in entries)
    )


def padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``rows`` with zero rows appended up to ``count`` (uneven shards, laid out as DTensor does)."""
    if rows.shape[0] == count:
        return rows
    out = rows.new_zeros((count, *rows.shape[1:]))
    out[: rows.shape[0]] = rows
    return out


def unreduced(
    grads: list[torch.Tensor],
    mesh: DeviceMesh,
    entries: Sequence[ParamPlan],
    strides: Sequence[tuple[int, ...]],
) -> list[DTensor]:
    """``grads`` (local, laid out as their entries' ``grad``) cast to the dtype they are
    summed in over microbatches (:func:`accumulated_dtype`), scaled, and returned as those
    ``Partial`` DTensors, for the step to reduce once (microbatch accumulation)."""
    return [
        DTensor.from_local(
            scaled_grad(g.to(accumulated_dtype(e)), e),
            mesh,
            e.grad,
            run_check=False,
            shape=torch.Size(e.shape),
            stride=stride,
        )
        for g, e, stride in zip(grads, entries, strides, strict=True)
    ]


def reduce_many(
    grads: list[torch.Tensor],
    mesh: DeviceMesh,
    entries: Sequence[ParamPlan],
    axis: int,
    groups: tuple[str, ...],
    kept: Sequence[Placement],
    mine: Sequence[int],
    strides: Sequence[tuple[int, ...]],
) -> list[DTensor]:
    """``grads`` (local, laid out as their entries' ``grad``: ``Partial`` on mesh ``axis``)
    reduced over ``axis`` in one collective to ``kept``, their placements on ``axis``: all
    ``Shard(dim)``, one reduce-scatter of their rows padded to equal chunks (as DTensor lays
    uneven shards out); all ``Replicate``, one all-reduce. Then one all-reduce per other axis
    over which every grad is ``Partial`` and kept whole (HSDP's replicate axis), after the
    sharded axis (1/n of the bytes), and each to its entry's ``grad_kept``
    (:func:`reduce_to`), in the reduce dtype. Grads are cast to the reduce dtype and scaled
    by ``grad_scale`` first.

    Entries must share the reduce dtype and the grad's placement on ``axis``, and no other
    axis may shard a ``kept`` dim (nested shards are split over the mesh's axes in order,
    not as rows of a local grad): :func:`reducible` says which can. ``groups``: the mesh
    axes' process group names; ``mine``: the rows of each grad's ``kept`` dim this rank
    keeps (unused for ``Replicate``); ``strides``: the params' global strides.
    """
    first = entries[0]
    scaled = [
        scaled_grad(g.to(first.reduce_dtype or first.dtype), e)
        for g, e in zip(grads, entries, strict=True)
    ]
    ranks, group = mesh.shape[axis], groups[axis]
    if isinstance(kept[0], Shard):
        pieces, layouts = [], []
        for grad, where in zip(scaled, kept, strict=True):
            dim = where.dim
            chunk = -(-grad.shape[dim] // ranks)
            whole = padded(grad.movedim(dim, 0), ranks * chunk).movedim(0, dim)
            # Each rank's piece is its rows of `dim` in its shard's own order, so that its
            # grad is a view of the reduce-scatter's output whatever the dim (as FSDP2 lays
            # Shard(dim > 0) out), not a copy that leaves the output held beside it.
            pieces.append(whole.unflatten(dim, (ranks, chunk)).movedim(dim, 0).reshape(ranks, -1))
            layouts.append((dim, (*grad.shape[:dim], chunk, *grad.shape[dim + 1 :])))
        flat = torch.cat(pieces, dim=1).reshape(-1)
        if ranks > 1:  # over one rank the sum is the grad: no collective, as DTensor skips it
            flat = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(flat, "sum", ranks, group))
    else:
        flat = torch.cat([g.reshape(-1) for g in scaled])
        if ranks > 1:
            flat = _c10d.wait_tensor(_c10d.all_reduce(flat, "sum", group))
        layouts = None
    if first.grad[axis].reduce_op == "avg" and ranks > 1:
        flat = flat / ranks
    over = _reduced_together(tuple(entries), axis)
    for other in over:
        if mesh.shape[other] == 1:
            continue
        flat = _c10d.wait_tensor(_c10d.all_reduce(flat, "sum", groups[other]))
        if first.grad[other].reduce_op == "avg":
            flat = flat / mesh.shape[other]
    out, offset = [], 0
    for n, (grad, entry, where, stride) in enumerate(
        zip(scaled, entries, kept, strides, strict=True)
    ):
        if layouts is None:
            local = flat[offset : offset + grad.numel()].view(grad.shape)
            offset += grad.numel()
        else:
            dim, shard = layouts[n]
            size = math.prod(shard)
            local = flat[offset : offset + size].view(shard).narrow(dim, 0, mine[n])
            offset += size
        placements = tuple(
            where if i == axis else Replicate() if i in over else p
            for i, p in enumerate(entry.grad)
        )
        # A view even where uneven shards of a dim > 0 leave it strided (as DTensor's own
        # reduce-scatter does): a copy would be held beside the output the others keep.
        grad = DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(entry.shape),
            stride=stride,
        )
        out.append(_kept_in(reduce_to(grad, entry.grad_kept), grad, local))
    return out


def _kept_in(reduced: DTensor, grad: DTensor, view: torch.Tensor) -> DTensor:
    """``reduced`` (``grad`` reduced further: a norm's grad all-reduced over ``tp``) with its
    local tensor copied back into ``view``, ``grad``'s rows of the collective's output, which
    the group's other grads keep alive whole: no second copy of it is held."""
    local = reduced.to_local()
    if reduced is grad or local.shape != view.shape or not view.is_contiguous():
        return reduced
    return DTensor.from_local(
        view.copy_(local),
        reduced.device_mesh,
        reduced.placements,
        run_check=False,
        shape=reduced.shape,
        stride=reduced.stride(),
    )
