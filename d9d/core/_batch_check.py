"""The batch a step is called with: its leaves agree on the batch size, and every rank of the
mesh passes the same shapes. Checked on a step's first call and whenever the shapes change."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import tree
from ..errors import BatchShapeError, IndivisibleError

__all__ = ["BatchSignature", "batch_signature", "check_batch"]

BatchSignature = tuple[Any, tuple[tuple[torch.Size, torch.dtype] | None, ...]]
"""A batch's structure and each tensor leaf's shape and dtype: cheap to build and compare."""


def batch_signature(batch: Any) -> BatchSignature:
    """What :func:`check_batch` depends on; equal signatures need no second check."""
    leaves, spec = tree.flatten(batch)
    return spec, tuple(
        (leaf.shape, leaf.dtype) if isinstance(leaf, torch.Tensor) else None for leaf in leaves
    )


def check_batch(batch: Any, mesh: DeviceMesh) -> None:
    """Raise unless the batch's leaves agree on dim 0 and every rank of ``mesh`` passes the same
    shapes and dtypes (one all-gather of the shapes per mesh axis: the caller runs this only
    when the signature changes).

    Raises:
        IndivisibleError: Leaves of this rank's batch hold different numbers of examples.
        BatchShapeError: Another rank's batch has other shapes, dtypes or leaves.
    """
    pairs = [
        (path, leaf)
        for path, leaf in tree.flatten_with_paths(batch)[0]
        if isinstance(leaf, torch.Tensor)
    ]
    sizes = {path: leaf.shape[0] for path, leaf in pairs if leaf.ndim > 0}
    if len(set(sizes.values())) > 1:
        raise IndivisibleError(
            f"batch leaves disagree on the batch size (dim 0): {sizes}; every tensor in the "
            "batch must hold the same number of examples (dim 0 is the batch, which "
            "microbatches and data-parallel shards split): expand a tensor shared by every "
            "example (a mask or positions [1, S]) to the batch size, or build it in the loss "
            "function"
        )
    if mesh.size() > 1:
        shapes = ", ".join(
            f"{path}: {str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}"
            for path, leaf in pairs
        )
        _check_same_on_ranks(shapes, mesh)


def _check_same_on_ranks(shapes: str, mesh: DeviceMesh) -> None:
    names = tuple(mesh.mesh_dim_names or ())
    coordinate = ", ".join(f"{n}={c}" for n, c in zip(names, mesh.get_coordinate(), strict=True))
    seen = {dist.get_rank(): (coordinate, shapes)}
    for dim in range(mesh.ndim):  # after the hop over axis i, a rank knows its whole i-slab
        if mesh.size(dim) == 1:
            continue
        gathered: list[Any] = [None] * mesh.size(dim)
        dist.all_gather_object(gathered, seen, group=mesh.get_group(dim))
        seen = {rank: entry for part in gathered for rank, entry in part.items()}
    first = min(seen)
    for rank in sorted(seen):
        if seen[rank][1] != seen[first][1]:
            (at_first, first_shapes), (at_rank, rank_shapes) = seen[first], seen[rank]
            raise BatchShapeError(
                f"ranks pass batches of different shapes: rank {first} ({at_first}) passes "
                f"{{{first_shapes}}} but rank {rank} ({at_rank}) passes {{{rank_shapes}}}; "
                "every rank "
                "must pass a batch of the same shapes (its data-parallel share, "
                "step.shard_batch(global_batch); drop or pad a last partial batch)"
            )
