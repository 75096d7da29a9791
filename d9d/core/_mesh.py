"""``make_mesh``: a DeviceMesh with named axes in d9d's fixed order."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import MeshError
from ._mesh_hash import pin_hash

__all__ = ["AXIS_ORDER", "make_mesh"]

AXIS_ORDER = ("pp", "dp", "fsdp", "cp", "tp", "ep")
"""Mesh axes outermost first: pipeline stages span nodes, tensor parallelism stays inside one."""


def make_mesh(device_type: str | None = None, **axes: int) -> DeviceMesh:
    """A device mesh over all ranks with the given named axes, in the order of ``AXIS_ORDER``.

    Axes are laid out outermost first (``pp`` varies slowest, ``ep`` fastest), whatever the
    keyword order; axes of size 1 are kept, so transforms can name them; one axis may be
    ``-1``, meaning "all the ranks the others leave".

    In a process that is not part of a job (no process group, no ``torchrun``), a mesh whose
    axes are all 1 is built over a one-rank process group that ``make_mesh`` starts on an
    in-process store, as ``jax`` has one device without a launcher: a one-device step runs
    with the transforms that need no other rank (``remat``, ``shard_params`` over ``fsdp=1``).

    Args:
        device_type: ``"cuda"`` or ``"cpu"`` (a device type, no index); default ``"cuda"``
            when CUDA is available.
        **axes: Axis sizes by name, from ``pp, dp, fsdp, cp, tp, ep``.

    Returns:
        The ``DeviceMesh``, with ``mesh_dim_names`` set.

    Raises:
        MeshError: ``device_type`` is not a device type, or one this machine does not have
            (a ``fake_world`` stands in for every type it simulates); an axis name is
            unknown, a size is not a positive int (or one ``-1``), the
            sizes do not multiply to the world size, or they need other ranks and no job
            started them (launch with ``torchrun``; under it, call
            ``d9d.init_process_group()`` first).

    Example:
        >>> from d9d.testing import fake_world
        >>> with fake_world(8):
        ...     make_mesh("cpu", tp=2, fsdp=-1).mesh_dim_names
        ('fsdp', 'tp')
    """
    unknown = sorted(set(axes) - set(AXIS_ORDER))
    if unknown:
        raise MeshError(f"unknown mesh axes {unknown}; axes are {AXIS_ORDER}")
    # Every check that needs no world size comes first: a refused call starts no group.
    if not axes:
        world = dist.get_world_size() if dist.is_initialized() else 1
        raise MeshError(f"make_mesh needs at least one axis, e.g. make_mesh(fsdp={world})")
    _check_sizes(axes)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    _check_device_type(device_type)
    if not dist.is_initialized():
        _start_one_rank_group(axes)
    sizes = _resolve_sizes(axes, dist.get_world_size())
    names = tuple(name for name in AXIS_ORDER if name in sizes)
    mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
    return pin_hash(mesh)


def _check_device_type(device_type: object) -> None:
    """Raise unless ``device_type`` is a bare torch device type that this process has, or that
    the process group simulates (``fake_world``'s backend serves meshes of ``"cuda"`` on a
    machine without one: ``d9d plan`` lays GPU worlds out on meta tensors)."""
    try:
        device = torch.device(device_type)  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        raise MeshError(
            f"make_mesh(device_type={device_type!r}) is not a torch device type; pass 'cuda' or "
            "'cpu' (or leave it out: 'cuda' where there is one, else 'cpu')"
        ) from None
    if device.index is not None:
        raise MeshError(
            f"make_mesh(device_type={device_type!r}) names one device, but a mesh spans every "
            f"rank's: pass the type alone, {device.type!r} (each rank uses its current device; "
            "d9d.init_process_group() sets it from LOCAL_RANK)"
        )
    module = getattr(torch, device.type, None)
    if device.type in ("cpu", "meta") or not callable(getattr(module, "is_available", None)):
        return
    if module.is_available():  # type: ignore[union-attr]
        return
    if dist.is_initialized():
        config = dict(
            part.split(":", 1) for part in str(dist.get_backend_config()).split(",") if ":" in part
        )
        if config.get(device.type) == "fake":
            return
    raise MeshError(
        f"make_mesh(device_type={device_type!r}) but this machine has no {device.type} device "
        f"(torch.{device.type}.is_available() is False); pass 'cpu', or leave device_type out "
        "to get 'cuda' where there is one"
    )


def _start_one_rank_group(axes: dict[str, int]) -> None:
    """Start the process group of a one-process world, when ``axes`` need no other rank."""
    ranks = math.prod(size for size in axes.values() if isinstance(size, int) and size > 0)
    shape = ", ".join(f"{name}={size}" for name, size in axes.items())
    if "RANK" in os.environ:
        raise MeshError(
            f"make_mesh({shape}) runs under torchrun (RANK={os.environ['RANK']}, WORLD_SIZE="
            f"{os.environ.get('WORLD_SIZE', '?')}) but this process has not joined the job: "
            "call d9d.init_process_group() before make_mesh"
        )
    if ranks > 1:
        raise MeshError(
            f"make_mesh({shape}) spans {ranks} ranks but this process was started alone (no "
            f"process group, no torchrun): launch it with `torchrun --nproc-per-node {ranks} "
            "script.py` and call d9d.init_process_group() first; one process builds meshes "
            "whose axes are all 1"
        )
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)


def _check_sizes(axes: dict[str, int]) -> None:
    """Refuse sizes that are not positive ints or ``-1``, and more than one ``-1``."""
    for name, size in axes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise MeshError(f"mesh axis {name}={size!r} must be a positive int or -1")
    rest = [name for name, size in axes.items() if size == -1]
    if len(rest) > 1:
        raise MeshError(f"only one mesh axis may be -1, got {rest}")


def _resolve_sizes(axes: dict[str, int], world: int) -> dict[str, int]:
    rest = [name for name, size in axes.items() if size == -1]
    known = math.prod(size for size in axes.values() if size != -1)
    if rest:
        if world % known:
            raise MeshError(
                f"mesh axes {axes} leave {world} ranks / {known} for {rest[0]!r}, which does "
                f"not divide; choose sizes whose product divides the world size {world}"
            )
        axes = {**axes, rest[0]: world // known}
    product = math.prod(axes.values())
    if product != world:
        shape = " x ".join(f"{n}={s}" for n, s in axes.items())
        raise MeshError(
            f"mesh {shape} has {product} ranks but the world has {world}; make the sizes "
            f"multiply to {world} (or set one axis to -1)"
        )
    return axes
