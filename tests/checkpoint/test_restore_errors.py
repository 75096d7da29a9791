"""Damaged checkpoints and mismatched targets fail loudly, naming the path; targets stay intact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from d9d import checkpoint
from d9d import tree as tree_lib
from d9d.checkpoint import Abstract
from d9d.errors import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from d9d.testing import assert_trees_all_equal

TREE = {
    "layers": {"0": {"w": torch.arange(12.0).reshape(4, 3)}, "1": {"w": torch.ones(4, 3)}},
    "count": torch.tensor(7),
    "lr": 0.5,
}


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return checkpoint.save(tmp_path, TREE, step=1).wait()


def _target() -> Any:
    return tree_lib.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, TREE)


def _chunk(path: Path, leaf: str) -> Path:
    chunks = path / "arrays" / leaf / "c"  # a file for a 0-d array, else a folder
    return chunks if chunks.is_file() else next(p for p in chunks.rglob("*") if p.is_file())


def _restore_leaves_target_intact(path: Path, target: Any, error: type, match: str) -> None:
    before = tree_lib.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, target)
    with pytest.raises(error, match=match):
        checkpoint.restore(path, target)
    assert_trees_all_equal(target, before)


def test_flipped_byte_fails_its_checksum(saved: Path) -> None:
    chunk = _chunk(saved, "layers.1.w")
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0xFF
    chunk.write_bytes(bytes(data))
    _restore_leaves_target_intact(
        saved, _target(), CheckpointCorruptError, r"leaf 'layers.1.w' .* Digest mismatch"
    )


def test_truncated_chunk_is_corrupt(saved: Path) -> None:
    chunk = _chunk(saved, "layers.0.w")
    chunk.write_bytes(chunk.read_bytes()[:10])
    _restore_leaves_target_intact(saved, _target(), CheckpointCorruptError, r"'layers.0.w'")


def test_deleted_chunk_is_missing_not_zeros(saved: Path) -> None:
    _chunk(saved, "count").unlink()
    _restore_leaves_target_intact(saved, _target(), CheckpointCorruptError, r"'count' .* missing")


def test_deleted_array_metadata_is_corrupt(saved: Path) -> None:
    (saved / "arrays" / "layers.0.w" / "zarr.json").unlink()
    _restore_leaves_target_intact(
        saved, _target(), CheckpointCorruptError, r"leaf 'layers.0.w' .* restore an older"
    )


def test_other_model_shape_names_both_shapes(saved: Path) -> None:
    target = _target()
    target["layers"]["1"]["w"] = torch.zeros(8, 3)
    _restore_leaves_target_intact(
        saved,
        target,
        CheckpointMismatchError,
        r"'layers.1.w': shape \(4, 3\) in the checkpoint, \(8, 3\) in the target",
    )


def test_other_model_paths_are_listed(saved: Path) -> None:
    target = _target()
    target["layers"]["2"] = {"w": torch.zeros(4, 3)}
    del target["layers"]["0"]
    _restore_leaves_target_intact(
        saved,
        target,
        CheckpointMismatchError,
        r"(?s)in the target but not in the checkpoint: \['layers.2.w'\].*"
        r"in the checkpoint but not in the target: \['layers.0.w'\] \(pass partial=True",
    )


def test_partial_restores_only_the_target_paths(saved: Path) -> None:
    restored = checkpoint.restore(saved, {"layers": {"1": {"w": torch.zeros(4, 3)}}}, partial=True)
    assert_trees_all_equal(restored, {"layers": {"1": {"w": torch.ones(4, 3)}}})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"count": torch.tensor(7.0)}, r"'count': dtype int64 in the checkpoint, float32 in"),
        ({"count": 7}, r"'count': an array in the checkpoint, an int in the target"),
        ({"lr": torch.tensor(0.5)}, r"'lr': a float in the checkpoint, a tensor in the target"),
        ({"lr": 1}, r"'lr': a float in the checkpoint, an int in the target"),
    ],
)
def test_kind_and_dtype_mismatches(saved: Path, change: dict, match: str) -> None:
    _restore_leaves_target_intact(saved, {**_target(), **change}, CheckpointMismatchError, match)


def test_unfinished_or_absent_checkpoint_is_not_found(saved: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"It holds the checkpoints \['step_1'\]"):
        checkpoint.restore(saved.parent, _target())
    (saved / "COMMIT").unlink()
    match = r"not a complete checkpoint .*checkpoint\.latest\(directory\)"
    with pytest.raises(CheckpointNotFoundError, match=match):
        checkpoint.metadata(saved)


def test_bad_target_leaves_and_abstracts() -> None:
    with pytest.raises(TypeError, match=r"Target leaf 'x' is a object"):
        checkpoint.restore(_saved_once(), {"x": object()})
    with pytest.raises(ValueError, match=r"shape must be ints >= 0, got shape=\(-1,\)"):
        Abstract((-1,), torch.float32)
    with pytest.raises(TypeError, match=r"dtype must be a torch.dtype, got dtype='float32'"):
        Abstract((1,), "float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"takes mesh and placements together"):
        Abstract((1,), torch.float32, placements=())


def _saved_once(cache: dict[str, Path] = {}) -> Path:  # noqa: B006 - memo across calls
    if "path" not in cache:
        import tempfile

        cache["path"] = checkpoint.save(tempfile.mkdtemp(), TREE, step=1).wait()
    return cache["path"]


def test_abstract_placements_must_fit(one_rank_mesh) -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    with pytest.raises(ValueError, match=r"one placement per mesh axis: the mesh has 1 axes"):
        Abstract((4,), torch.float32, one_rank_mesh, (Replicate(), Replicate()))
    with pytest.raises(ValueError, match=r"'Abstract' is Partial on mesh axis 0"):
        Abstract((4,), torch.float32, one_rank_mesh, (Partial(),))
    with pytest.raises(ValueError, match=r"Shard\(d\) with 0 <= d < 1 and Replicate\(\) only"):
        Abstract((4,), torch.float32, one_rank_mesh, (Shard(1),))
    with pytest.raises(ValueError, match=r"placement _StridedShard"):
        Abstract((4,), torch.float32, one_rank_mesh, (_StridedShard(0, split_factor=2),))


def test_checkpoint_of_another_format_is_refused(saved: Path) -> None:
    meta = saved / "metadata.json"
    meta.write_text(meta.read_text().replace("d9d.checkpoint/1", "d9d.checkpoint/0"))
    with pytest.raises(CheckpointNotFoundError, match=r"holds format 'd9d.checkpoint/0', this"):
        checkpoint.restore(saved, _target())
