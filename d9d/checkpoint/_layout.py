"""Where each rank's piece of a tensor lies in the global array, and how it is chunked on disk.

A leaf of a checkpoint is one global zarr array. A DTensor's placements cut it into boxes
(an offset and a shape per rank) with ``torch.chunk`` semantics, as DTensor does: a dim of
size ``n`` split over ``k`` ranks gives pieces of ``ceil(n / k)``, the last ones shorter or
empty; a dim sharded over several mesh axes is split by each in placement order. The zarr
chunk grid is made to fit every box exactly, so each chunk file has a single writer and no
two ranks ever touch the same file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorstore as ts
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

__all__ = [
    "DTYPE_NAMES",
    "Box",
    "Layout",
    "box_slices",
    "brief",
    "check_placements",
    "chunk_shape",
    "dtype_from_name",
    "dtype_name",
    "layout_of",
    "local_box",
    "to_numpy",
    "writes_box",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""``(offset, shape)`` of a rank's piece of a global array."""

# A chunk larger than this is split along its leading dims (by small factors, so chunks
# stay aligned with every rank's box). Smaller chunks let tensorstore pipeline file reads,
# checksums and copies: reading 160 MB of fp32 took 0.46 s in 32 MiB chunks and 0.35 s in
# 8 MiB ones on a 2-core CPU; 16 MiB keeps an 8B model's train state near 6k files.
_CHUNK_BYTES = 16 << 20
_SPLIT_FACTORS = (2, 3, 5, 7)

_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
)
_BY_NAME = {str(d).removeprefix("torch."): d for d in _DTYPES}
DTYPE_NAMES = frozenset(_BY_NAME)
"""The dtype names a checkpoint stores."""


def dtype_name(dtype: torch.dtype, path: str) -> str:
    """The checkpoint (and zarr ``data_type``) name of ``dtype``, e.g. ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    if name not in _BY_NAME:
        raise TypeError(
            f"Leaf {path!r} has dtype {dtype}, which checkpoints do not store; supported: "
            f"{sorted(_BY_NAME)}. Cast it first."
        )
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name`` in a checkpoint's metadata."""
    return _BY_NAME[name]


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a contiguous CPU tensor, bf16/fp8 as ``ml_dtypes`` types."""
    np_dtype = ts.dtype(dtype_name(tensor.dtype, "")).numpy_dtype
    return tensor.reshape(-1).view(torch.uint8).numpy().view(np_dtype).reshape(tensor.shape)


@dataclass(frozen=True)
class Layout:
    """How a leaf is laid out over ranks: global shape, dtype, and its mesh and placements.

    ``mesh`` is ``None`` (and ``placements`` empty) for a plain tensor, which every rank
    holding it holds whole.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: DeviceMesh | None = None
    placements: tuple[Placement, ...] = ()

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape) if self.mesh is not None else ()

    def describe(self) -> dict[str, Any]:
        """JSON of the mesh and placements, recorded for the reader's information only."""
        if self.mesh is None:
            return {}
        names = self.mesh.mesh_dim_names
        return {
            "mesh": {"shape": list(self.mesh.shape), "axis_names": list(names or ())},
            "placements": [repr(p) for p in self.placements],
        }


def layout_of(path: str, leaf: torch.Tensor) -> Layout:
    """The layout of a tensor or DTensor leaf; rejects placements a checkpoint cannot hold."""
    if not isinstance(leaf, DTensor):
        return Layout(tuple(leaf.shape), leaf.dtype)
    layout = Layout(tuple(leaf.shape), leaf.dtype, leaf.device_mesh, tuple(leaf.placements))
    check_placements(path, layout.placements, len(layout.shape))
    return layout


def check_placements(path: str, placements: Sequence[Placement], ndim: int) -> None:
    """Raise unless every placement is ``Shard(d)`` of a real dim or ``Replicate()``."""
    for axis, placement in enumerate(placements):
        match placement:
            case Replicate():
                pass
            case Shard(dim=dim) if type(placement) is Shard and 0 <= dim < ndim:
                pass
            case Partial():
                raise ValueError(
                    f"Leaf {path!r} is Partial on mesh axis {axis}: its value is a pending sum, "
                    "not data. Reduce it first (e.g. .redistribute(placements=[Replicate()]))."
                )
            case _:
                raise ValueError(
                    f"Leaf {path!r} has placement {placement!r} on mesh axis {axis}; "
                    f"checkpoints hold Shard(d) with 0 <= d < {ndim} and Replicate() only. "
                    "Redistribute it first."
                )


def _pieces(size: int, splits: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, length)`` of each piece of ``range(size)`` split by ``splits`` in turn."""
    pieces = [(0, size)]
    for parts in splits:
        split = []
        for start, length in pieces:
            step = -(-length // parts)
            for i in range(parts):
                lo, hi = min(i * step, length), min((i + 1) * step, length)
                split.append((start + lo, hi - lo))
        pieces = split
    return pieces


def _axes_by_dim(layout: Layout) -> list[list[int]]:
    """For each tensor dim, the mesh axes that shard it, in placement order."""
    axes: list[list[int]] = [[] for _ in layout.shape]
    for axis, placement in enumerate(layout.placements):
        if isinstance(placement, Shard):
            axes[placement.dim].append(axis)
    return axes


def local_box(layout: Layout, coordinate: Sequence[int]) -> Box:
    """The box the rank at mesh ``coordinate`` holds (the whole array without a mesh)."""
    mesh_shape = layout.mesh_shape
    offset, shape = [], []
    for size, axes in zip(layout.shape, _axes_by_dim(layout), strict=True):
        index = 0
        for axis in axes:
            index = index * mesh_shape[axis] + coordinate[axis]
        start, length = _pieces(size, [mesh_shape[a] for a in axes])[index]
        offset.append(start)
        shape.append(length)
    return tuple(offset), tuple(shape)


def brief(error: BaseException) -> str:
    """``error`` in one line, without the full spec tensorstore appends to its messages."""
    text = str(error).split(" [tensorstore_spec=")[0]
    return f"{type(error).__name__}: {text}"


def box_slices(offset: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    """The index of a box into its global array (for tensorstore)."""
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def writes_box(layout: Layout, coordinate: Sequence[int]) -> bool:
    """Whether the rank at ``coordinate`` writes its box: it is at 0 on every unsharding axis.

    Replicas of a box differ only along axes that do not shard the leaf, so exactly one
    of them is at 0 on all of those axes.
    """
    return all(
        c == 0
        for c, p in zip(coordinate, layout.placements, strict=True)
        if not isinstance(p, Shard)
    )


def chunk_shape(layout: Layout) -> tuple[int, ...]:
    """A zarr chunk grid that every rank's box is a union of, chunks near ``_CHUNK_BYTES``.

    Along each dim the chunk is the gcd of all box boundaries (the whole dim when
    unsharded), so no chunk straddles two boxes; big chunks are then divided by small
    factors of their size, which keeps them aligned.
    """
    mesh_shape = layout.mesh_shape
    chunks = []
    for size, axes in zip(layout.shape, _axes_by_dim(layout), strict=True):
        bounds = {
            edge
            for start, length in _pieces(size, [mesh_shape[a] for a in axes])
            if length
            for edge in (start, start + length)
        } - {0, size}
        chunks.append(max(1, math.gcd(*bounds) if bounds else size))
    itemsize = layout.dtype.itemsize
    for dim in range(len(chunks)):
        while math.prod(chunks) * itemsize > _CHUNK_BYTES:
            factor = next((f for f in _SPLIT_FACTORS if chunks[dim] % f == 0), None)
            if factor is None:
                break
            chunks[dim] //= factor
    return tuple(chunks)
