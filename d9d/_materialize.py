"""Gathering a stored param for compute, and reducing its gradient back to storage."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from ._active import accumulating

__all__ = ["gather", "reduce_to"]


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
        ctx.reduce_dtype, ctx.defer = reduce_dtype or stored.dtype, accumulating()
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
