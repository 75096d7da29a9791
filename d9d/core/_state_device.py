"""Optimizer state kept on another device than the mesh's: DTensors whose shard is on it.

[Note: a DTensor kept on the host] ``shard_params(opt_state_device="cpu")`` keeps each state
leaf a DTensor of the param's mesh (its placements are the plan's, so checkpoints and
``step.memory`` read it like any other leaf) whose local shard lives in host memory.
``DTensor.from_local`` would move such a shard to the mesh's device; :func:`kept_on` builds
the DTensor around it as it is (FSDP2's CPU offload keeps its sharded params the same way).
The state itself never crosses to the device, so it stays in pageable memory (each update
writes new tensors: a pinned state would be pinned until the first step only); what crosses
each step, the grads going to the host, goes through pinned buffers (:func:`to_device`).
Where the host is the mesh's device (a CPU mesh), the shard is where it was and nothing is
copied: the same code runs, its copies no-ops.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["kept_on", "placed_on", "to_device"]


def to_device(tensor: torch.Tensor, device: torch.device, *, pin: bool) -> torch.Tensor:
    """``tensor`` on ``device`` (itself when it is there), copied asynchronously: wait for
    the copy before the host reads it. With ``pin``, a copy to the CPU lands in pinned memory
    (from the caching host allocator), which an accelerator can write asynchronously."""
    if tensor.device == device:
        return tensor
    if pin and device.type == "cpu":
        out = torch.empty_like(tensor, device=device, pin_memory=True)
        return out.copy_(tensor, non_blocking=True)
    return tensor.to(device, non_blocking=True)


def kept_on(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: torch.Size,
    stride: tuple[int, ...],
) -> DTensor:
    """A DTensor of ``mesh`` laid out ``placements`` whose shard is ``local``, on whatever
    device ``local`` is (``DTensor.from_local`` would move it to the mesh's)."""
    meta = torch.empty(local.shape, dtype=local.dtype, device="meta")
    spec = DTensor.from_local(
        meta, mesh, placements, run_check=False, shape=shape, stride=stride
    )._spec
    return DTensor(local, spec, requires_grad=local.requires_grad)


def placed_on(
    tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], device: torch.device
) -> DTensor:
    """``tensor`` (the full tensor every rank passes) laid out ``placements``, this rank's
    shard a copy on ``device``: cut where ``tensor`` is, never through the mesh's device."""
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    piece = tensor.detach()[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    local = torch.empty(piece.shape, dtype=piece.dtype, device=device).copy_(piece)
    return kept_on(local, mesh, placements, tensor.shape, tensor.stride())
