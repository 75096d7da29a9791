"""Reading boxes from chunk files equals tensorstore's reading of the same zarr arrays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tensorstore as ts
import torch

from d9d import checkpoint
from d9d.checkpoint import _format
from d9d.checkpoint._chunk_read import read_box
from d9d.errors import CheckpointCorruptError

# 7 x 6 x 5 in chunks of 2 x 3 x 5: edge chunks padded on dim 0, two chunks along dim 1.
SHAPE, CHUNKS = (7, 6, 5), [2, 3, 5]
BOXES = [
    ((0, 0, 0), (7, 6, 5)),  # everything, edge chunk included
    ((2, 0, 0), (4, 6, 5)),  # whole rows: chunks read straight into the output
    ((1, 2, 1), (5, 3, 3)),  # straddles chunks on every dim
    ((6, 3, 4), (1, 3, 1)),  # inside the padded edge chunk
]


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict]:
    """A checkpoint and the record of a bf16 array tensorstore wrote beside it in ``CHUNKS``."""
    values = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    path = checkpoint.save(tmp_path, {"w": values}, step=1).wait()
    record = dict(_format.metadata(path)["leaves"]["w"], chunks=CHUNKS, file="rechunked")
    spec = _format.array_spec(path, record)
    ts.open(spec, create=True).result().write(
        values.view(torch.int16).numpy().view("bfloat16")
    ).result()
    return path, record


@pytest.mark.parametrize("box", BOXES, ids=lambda box: f"{box[0]}+{box[1]}")
def test_a_box_equals_tensorstores_read(saved: tuple[Path, dict], box: tuple) -> None:
    path, record = saved
    got = read_box(path, record, box, torch.bfloat16)
    array = ts.open(_format.array_spec(path, record), open=True).result()
    (o0, o1, o2), (n0, n1, n2) = box
    expected = array[o0 : o0 + n0, o1 : o1 + n1, o2 : o2 + n2].read().result()
    assert torch.equal(got.view(torch.int16), torch.from_numpy(expected.view("int16")))


def test_a_chunk_with_extra_bytes_is_corrupt(saved: tuple[Path, dict]) -> None:
    path, record = saved
    chunk = path / record["file"] / "c" / "0" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes() + b"\0")
    with pytest.raises(ValueError, match=r"holds 65 bytes, not 64: it is truncated or overwritten"):
        read_box(path, record, ((0, 0, 0), (2, 3, 5)), torch.bfloat16)


def test_array_metadata_that_differs_from_the_checkpoints_is_corrupt(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, {"w": torch.zeros(4, 3)}, step=1).wait()
    zarr_json = path / "arrays" / "w" / "zarr.json"
    stored = json.loads(zarr_json.read_text())
    zarr_json.write_text(json.dumps({**stored, "shape": [4, 4]}))
    with pytest.raises(CheckpointCorruptError, match=r"leaf 'w' .*has shape=\[4, 4\]"):
        checkpoint.restore(path, {"w": torch.empty(4, 3)})
