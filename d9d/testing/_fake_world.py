"""A simulated world of any size in this one process, for plan checks on large meshes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

__all__ = ["fake_world"]


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Act as rank ``rank`` of a ``world_size``-rank world, without any other rank.

    Initialises the default process group with PyTorch's "fake" backend
    (``torch.testing._internal.distributed.fake_pg``), which never communicates: every
    collective and point-to-point op, on CPU, CUDA or meta tensors, returns at once with
    meaningless data. Device meshes, their coordinates and DTensor placements and local
    shapes are real, so a 64-rank ``init_device_mesh`` and the placement plan over it are
    built in milliseconds. Use it to check plans, shapes and error messages, never values.
    The group is destroyed on exit, and DTensor's sharding caches cleared (their entries
    hold this world's meshes).

    Args:
        world_size: Number of simulated ranks (>= 1).
        rank: The rank this process plays (default 0).

    Raises:
        ValueError: ``world_size`` < 1 or ``rank`` not in ``[0, world_size)``.
        RuntimeError: A default process group is already initialised here.

    Example:
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> with fake_world(64, rank=9):
        ...     tuple(init_device_mesh("cpu", (8, 8)).get_coordinate())
        (1, 1)
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"{world_size=} must be an int >= 1.")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(f"{rank=} must be an int in [0, {world_size}) for {world_size=}.")
    if dist.is_initialized():
        raise RuntimeError(
            "fake_world needs this process to have no default process group, but one is "
            f"initialised (backend {dist.get_backend()!r}, world size "
            f"{dist.get_world_size()}). Destroy it first, or do not nest fake_world blocks."
        )
    # meta too: a dry run of a pipeline step batches point-to-point ops of meta tensors.
    backend = "cpu:fake,cuda:fake,meta:fake"
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor caches sharding decisions keyed by mesh layout, not identity, and the
        # outputs carry the cached mesh: a later world in this process (or a fork of it)
        # with an equal mesh would otherwise get DTensors on this world's dead groups.
        _clear_sharding_prop_cache()
