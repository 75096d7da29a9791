"""Optimizer state kept on another device than the mesh's: DTensors whose shard is on it.

[Note: a DTensor kept on the host] ``shard_params(opt_state_device="cpu")`` keeps each state
leaf a DTensor of the param's mesh (its placements are the plan's, so checkpoints and
``step.memory`` read it like any other leaf) whose local shard lives in host memory, pinned
when the mesh is on an accelerator so copies to and from it can be asynchronous.
``DTensor.from_local`` would move such a shard to the mesh's device; :func:`kept_on` builds
the DTensor around it as it is (FSDP2's CPU offload keeps its sharded params the same way).
Where the host is the mesh's device (a CPU mesh), the shard is where it was and nothing is
copied: the same code runs, its copies no-ops.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

__all__ = ["kept_on", "moved_to", "to_device"]


def to_device(tensor: torch.Tensor, device: torch.device, *, pin: bool) -> torch.Tensor:
    """``tensor`` on ``device`` (itself when it is there), in pinned memory when ``pin`` and
    it is copied to the CPU: an accelerator copies to and from pinned pages asynchronously."""
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


def moved_to(leaf: DTensor, device: torch.device) -> DTensor:
    """``leaf`` with its shard on ``device`` (pinned host memory when that is the CPU and the
    mesh is on an accelerator), laid out as it was."""
    mesh = leaf.device_mesh
    local = to_device(leaf.to_local(), device, pin=mesh.device_type != "cpu")
    return kept_on(local, mesh, tuple(leaf.placements), leaf.shape, leaf.stride())
