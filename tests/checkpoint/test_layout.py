"""Boxes agree with DTensor's own sharding; chunk grids fit every box; dtypes round-trip bytes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from d9d.checkpoint._layout import (
    _DTYPES,
    Layout,
    chunk_shape,
    local_box,
    to_numpy,
    writes_box,
)

CASES = [
    ((7, 5), (4,), (Shard(0),)),
    ((3, 5), (4,), (Shard(0),)),  # the last rank holds nothing
    ((8, 6), (2, 2), (Shard(0), Shard(1))),
    ((9, 6), (2, 2), (Replicate(), Shard(0))),
    ((10, 3), (2, 2), (Shard(0), Shard(0))),  # one dim over two axes, unevenly
    ((13, 11), (3, 2), (Shard(1), Shard(0))),
    ((0, 4), (2,), (Shard(0),)),
    ((5,), (2, 3), (Replicate(), Replicate())),
]


class _Mesh:
    """Just the shape a Layout reads from a mesh."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


def _layout(shape, mesh_shape, placements, dtype=torch.float32) -> Layout:
    return Layout(shape, dtype, _Mesh(mesh_shape), placements)  # type: ignore[arg-type]


def _coordinates(mesh_shape):
    return itertools.product(*(range(n) for n in mesh_shape))


@pytest.mark.parametrize(("shape", "mesh_shape", "placements"), CASES)
def test_boxes_match_dtensor(shape, mesh_shape, placements) -> None:
    layout = _layout(shape, mesh_shape, placements)
    for coordinate in _coordinates(mesh_shape):
        offset, local = local_box(layout, coordinate)
        torch_local, torch_offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coordinate), placements
        )
        assert local == tuple(torch_local), coordinate
        if math.prod(local):  # DTensor puts empty shards at the end, any offset does
            assert offset == tuple(torch_offset), coordinate


@pytest.mark.parametrize(("shape", "mesh_shape", "placements"), CASES)
def test_written_boxes_tile_the_array_once(shape, mesh_shape, placements) -> None:
    layout = _layout(shape, mesh_shape, placements)
    chunks = chunk_shape(layout)
    covered = torch.zeros(shape, dtype=torch.int64)
    for coordinate in _coordinates(mesh_shape):
        offset, local = local_box(layout, coordinate)
        if not writes_box(layout, coordinate):
            continue
        index = tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))
        covered[index] += 1
        for o, n, c, size in zip(offset, local, chunks, shape, strict=True):
            if n:  # each written box is a union of whole chunks
                assert o % c == 0 and ((o + n) % c == 0 or o + n == size)
    assert bool((covered == 1).all())


def test_big_chunks_are_split_into_aligned_pieces() -> None:
    layout = _layout((4096, 8192), (2,), (Shard(0),))  # 64 MiB per rank's box
    chunks = chunk_shape(layout)
    assert math.prod(chunks) * 4 <= 16 << 20
    assert 2048 % chunks[0] == 0 and 8192 % chunks[1] == 0
    assert chunk_shape(_layout((4099, 4096), (1,), (Shard(0),))) == (4099, 512)  # prime rows


def test_plain_tensor_is_one_box() -> None:
    layout = Layout((3, 4), torch.float32)
    assert local_box(layout, ()) == ((0, 0), (3, 4))
    assert chunk_shape(layout) == (3, 4)
    assert chunk_shape(Layout((), torch.int64)) == ()


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_numpy_views_keep_the_bytes(dtype: torch.dtype) -> None:
    raw = torch.randint(0, 256, (3, 4 * dtype.itemsize), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    tensor = raw.view(dtype)
    array = to_numpy(tensor)
    assert array.shape == tuple(tensor.shape) and array.dtype.itemsize == dtype.itemsize
    assert torch.equal(torch.from_numpy(array.view("uint8")), raw)
