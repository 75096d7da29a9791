"""What one rank holds for a step: ``Memory``, and ``step_memory``, which counts it from the
plan and the placed trees (``TransformedStep.memory``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .. import tree
from ._accumulated_dtype import accumulated_dtype
from ._param_plan import ParamPlan
from ._placed_trees import kept_apart
from ._plan import Plan
from ._runtime import Runtime

__all__ = ["Memory", "local_bytes", "step_memory"]


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds for params, grads and optimizer state on the mesh's device, and
    optimizer state kept on the host (``shard_params(opt_state_device="cpu")``).

    ``accumulated_grads``: the whole, unreduced grads a step that reduces once a step holds
    from its first microbatch's backward to that reduction (``shard_params(microbatches=k)``
    with ``k > 1``, every ``pipeline`` step): each param's grad in its compute layout (a
    ZeRO-3 param's whole, not its shard), in the dtype they are summed in (the widest of
    the stored, compute and reduce dtypes: ``accumulated_dtype``); 0 when each block's
    grads are reduced as its backward ends. They are held beside the last microbatch's
    activations, not at the update: :attr:`total` leaves them out, :attr:`at_reduction`
    counts them.

    ``widened_params``: under ``shard_params(microbatches=k)`` or ``fault_tolerant`` (which
    reduces the grads over replica groups in that dtype), the copies in that dtype of
    the params stored narrower (bf16 params, ``reduce_dtype=torch.float32``) that
    ``d9d.value_and_grad`` differentiates, each laid out as the step body sees its param
    (ZeRO-1/2/3: this rank's shard): made for each microbatch and held through its forward
    and backward, beside ``accumulated_grads``; freed before the reduction, so neither
    :attr:`total` nor :attr:`at_reduction` counts them.
    """

    params: int
    grads: int
    opt_state: int
    host_opt_state: int = 0
    accumulated_grads: int = 0
    widened_params: int = 0

    @property
    def total(self) -> int:
        """Bytes on the mesh's device at the update: params, grads and the optimizer state
        kept there."""
        return self.params + self.grads + self.opt_state

    @property
    def at_reduction(self) -> int:
        """Bytes on the mesh's device when the accumulated grads are reduced: params,
        :attr:`accumulated_grads` and the optimizer state kept there (:attr:`total` when the
        step accumulates nothing)."""
        if not self.accumulated_grads:
            return self.total
        return self.params + self.accumulated_grads + self.opt_state

    def __str__(self) -> str:
        host = (
            f"; optimizer state on the host {self.host_opt_state:,} B"
            if self.host_opt_state
            else ""
        )
        accumulated = (
            f"; whole grads accumulated over microbatches {self.accumulated_grads:,} B "
            f"({self.at_reduction:,} B per rank at their reduction)"
            if self.accumulated_grads
            else ""
        )
        widened = (
            f"; params widened for their microbatch sums {self.widened_params:,} B"
            if self.widened_params
            else ""
        )
        return (
            f"params {self.params:,} B, grads {self.grads:,} B, optimizer state "
            f"{self.opt_state:,} B: {self.total:,} B per rank{host}{accumulated}{widened}"
        )


def step_memory(plan: Plan, runtimes: Sequence[Runtime], params: Any, opt_state: Any) -> Memory:
    """What a rank holds at the update of a step under ``plan`` with ``runtimes`` (see
    :meth:`d9d.core._step.TransformedStep.memory`), from the placed ``params`` and
    ``opt_state``."""
    param_bytes = sum(local_bytes(leaf) for leaf in tree.leaves(params))
    grad_bytes = 0
    for path in params:
        entry = plan.entries[path]
        if entry.grad_kept == entry.state_kept:  # ZeRO-2, -3: views of the reduction
            local = _held_grad_shape(entry, plan.mesh)
        else:  # ZeRO-1: this rank's rows of its all-reduced grad, copied out
            local, _ = compute_local_shape_and_global_offset(
                entry.shape, plan.mesh, entry.state_kept
            )
        grad_bytes += math.prod(local) * entry.dtype.itemsize
    accumulated = widened = 0
    if any(r.accumulates_grads for r in runtimes):
        for path in params:
            entry = plan.entries[path]
            local = entry.local_shape(plan.mesh, entry.compute)
            accumulated += math.prod(local) * accumulated_dtype(entry).itemsize
    if any(r.defers_reduction or r.widens_grads for r in runtimes):  # _summed_wider's copies
        for path in params:
            entry = plan.entries[path]
            wide = accumulated_dtype(entry)
            if wide != entry.dtype:
                local, _ = compute_local_shape_and_global_offset(
                    entry.shape, plan.mesh, entry.state_kept
                )
                widened += math.prod(local) * wide.itemsize
    on_device = on_host = 0
    for leaf, apart in zip(tree.leaves(opt_state), kept_apart(opt_state, plan), strict=True):
        if apart:
            on_host += local_bytes(leaf)
        else:
            on_device += local_bytes(leaf)
    return Memory(param_bytes, grad_bytes, on_device, on_host, accumulated, widened)


def _held_grad_shape(entry: ParamPlan, mesh: DeviceMesh) -> tuple[int, ...]:
    """The local shape of ``entry``'s grad as the update holds it: its kept shard, padded to
    the largest shard along a dim it was reduce-scattered on (a view of the collective's
    padded output, d9d's and DTensor's alike: uneven shards hold their padding)."""
    shape = list(compute_local_shape_and_global_offset(entry.shape, mesh, entry.grad_kept)[0])
    before = compute_local_shape_and_global_offset(entry.shape, mesh, entry.grad)[0]
    for size, grad, kept in zip(mesh.shape, entry.grad, entry.grad_kept, strict=True):
        if isinstance(grad, Partial) and isinstance(kept, Shard):
            shape[kept.dim] = -(-before[kept.dim] // size)
    return tuple(shape)


def local_bytes(leaf: Any) -> int:
    """Bytes of this rank's part of ``leaf`` (a DTensor's shard, a tensor; 0 otherwise)."""
    if isinstance(leaf, DTensor):
        leaf = leaf.to_local()
    return leaf.numel() * leaf.element_size() if isinstance(leaf, torch.Tensor) else 0
