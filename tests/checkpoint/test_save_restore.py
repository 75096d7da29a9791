"""Round trips: saved under one layout, restored bitwise under another; async, atomic, rotated."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from checkpoint_trees import LAYOUTS, TREE, place
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from d9d import checkpoint
from d9d import tree as tree_lib
from d9d.checkpoint import Abstract
from d9d.errors import CheckpointExistsError, CheckpointSaveError
from d9d.testing import assert_trees_all_equal, run_on_ranks


def _clone(tree: Any) -> Any:
    return tree_lib.map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _zero_(tree: Any) -> None:
    for leaf in tree_lib.leaves(tree):
        if isinstance(leaf, DTensor):
            leaf.to_local().zero_()
        elif isinstance(leaf, torch.Tensor):
            leaf.zero_()


def _meta(tree: Any) -> Any:
    return tree_lib.map(
        lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x, tree
    )


def _zeros(x: Any) -> Any:
    return torch.zeros_like(x) if isinstance(x, torch.Tensor) else x


def _abstract(x: Any) -> Any:
    return Abstract.like(x) if isinstance(x, torch.Tensor) else x


def test_round_trip_on_one_process_is_a_snapshot(tmp_path: Path) -> None:
    tree = _clone(TREE)
    handle = checkpoint.save(tmp_path, tree, step=1)
    _zero_(tree)  # the host copy was taken before save returned
    assert handle.wait() == tmp_path / "step_1" and handle.done()
    restored = checkpoint.restore(handle.path, _meta(TREE))
    assert_trees_all_equal(restored, TREE)  # NamedTuples of the optimizer state included
    assert type(restored["opt_state"][0]) is type(TREE["opt_state"][0])


def test_restore_without_target_gives_flat_cpu_tensors(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, TREE, step=1, async_=False).path
    flat = checkpoint.restore(path)
    assert flat == {**flat, "step": 1, "name": "tiny"}
    expected = dict(tree_lib.flatten_with_paths(TREE)[0])
    assert_trees_all_equal(flat, expected)


@pytest.mark.parametrize(
    "dtype",
    [torch.bool, torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2],
    ids=str,
)
def test_one_byte_dtypes_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    # tensorstore writes a one-byte array's bytes codec without a byte order; the restore's
    # check of zarr.json once wanted {"endian": "little"} there and called every such leaf damaged.
    raw = torch.randint(
        0, 256, (3, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    leaf = (raw % 2).bool() if dtype == torch.bool else raw.view(dtype)
    path = checkpoint.save(tmp_path, {"w": leaf, "s": leaf[0, 0].clone()}, step=1).wait()
    restored = checkpoint.restore(path, {"w": _meta(leaf), "s": _meta(leaf[0, 0])})
    for got, want in ((restored["w"], leaf), (restored["s"], leaf[0, 0])):
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_leaf_paths_longer_than_a_file_name_round_trip(tmp_path: Path) -> None:
    # A leaf's array folder is its URL-quoted path; past 255 bytes the save failed
    # ("File name too long"). Such names are now cut and end with a hash of the path.
    tree = {"x" * 300: torch.arange(3.0), "x" * 299 + "y": torch.ones(2), "ü" * 100: torch.zeros(1)}
    path = checkpoint.save(tmp_path, tree, step=1).wait()
    folders = [p.name for p in (path / "arrays").iterdir()]
    assert len(folders) == 3 and max(len(name) for name in folders) == 255
    assert_trees_all_equal(checkpoint.restore(path, _meta(tree)), tree)
    assert_trees_all_equal(checkpoint.restore(path), tree)


@pytest.mark.parametrize("async_", [True, False], ids=["async", "sync"])
def test_views_round_trip_as_their_values(tmp_path: Path, async_: bool) -> None:
    # A synchronous save wrote CPU tensors through .contiguous(), which keeps a conjugate or
    # negative view's bit: the save failed ("view is not supported for conjugate view
    # tensors"), where the asynchronous one's host copy resolved it.
    g = torch.Generator().manual_seed(0)
    z, x = torch.randn(3, 4, dtype=torch.complex64, generator=g), torch.randn(3, 5, generator=g)
    tree = {"conj": z.conj(), "neg": z._neg_view(), "t": x.t(), "col": x[:, 2], "empty": x[:0]}
    path = checkpoint.save(tmp_path, tree, step=1, async_=async_).wait()
    expected = {k: v.resolve_conj().resolve_neg().contiguous() for k, v in tree.items()}
    assert_trees_all_equal(checkpoint.restore(path, _meta(tree)), expected)


@pytest.fixture(scope="module")
def fsdp4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``TREE`` saved by 4 ranks under ``fsdp=4`` (Shard(0), uneven and empty shards)."""
    directory = tmp_path_factory.mktemp("fsdp4")

    def save() -> str:
        tree, _ = place(_clone(TREE), "fsdp=4")
        handle = checkpoint.save(directory, tree, step=3, metadata={"loader": {"step": 3}})
        _zero_(tree)
        return str(handle.wait())

    paths = run_on_ranks(save, 4)
    assert len(set(paths)) == 1
    return Path(paths[0])


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("abstract", [False, True], ids=["dtensor", "abstract"])
def test_fsdp4_restores_bitwise_under(fsdp4_checkpoint: Path, layout: str, abstract: bool) -> None:
    def restore() -> None:
        expected, _ = place(TREE, layout)
        target = tree_lib.map(_abstract if abstract else _zeros, expected)
        restored = checkpoint.restore(fsdp4_checkpoint, target)
        for (path, got), want in zip(
            tree_lib.flatten_with_paths(restored)[0], tree_lib.leaves(expected), strict=True
        ):
            if isinstance(want, DTensor):
                assert isinstance(got, DTensor), path
                assert got.placements == want.placements and got.shape == want.shape, path
                assert_trees_all_equal(got.to_local(), want.to_local())
            else:
                assert got == want, path

    run_on_ranks(restore, math.prod(LAYOUTS[layout][0]))


@pytest.mark.distributed
def test_fsdp4_restores_on_one_device(fsdp4_checkpoint: Path) -> None:
    restored = checkpoint.restore(fsdp4_checkpoint, _meta(TREE))
    assert_trees_all_equal(restored, TREE)
    meta = checkpoint.metadata(fsdp4_checkpoint)
    assert meta["step"] == 3 and meta["world_size"] == 4
    assert meta["metadata"] == {"loader": {"step": 3}}
    uneven = meta["leaves"]["odd.uneven"]
    assert uneven["mesh"] == {"shape": [4], "axis_names": ["fsdp"]}
    assert uneven["placements"] == ["Shard(dim=0)"] and uneven["chunks"] == [2, 3]


@pytest.mark.distributed
def test_replicas_and_shards_are_written_exactly_once(tmp_path: Path) -> None:
    def boxes() -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        tree, _ = place(TREE, "dp=2 x fsdp=2")
        handle = checkpoint.save(tmp_path, tree, step=1)
        handle.wait()
        return [
            (w.spec["kvstore"]["path"], w.offset, tuple(w.data.shape)) for w in handle._job.writes
        ]

    counts: dict[str, torch.Tensor] = {}
    meta = None
    for rank_boxes in run_on_ranks(boxes, 4):
        for file, offset, shape in rank_boxes:
            meta = meta or checkpoint.metadata(tmp_path / "step_1")
            leaf = next(r for r in meta["leaves"].values() if file.endswith(r.get("file", "-")))
            counts.setdefault(file, torch.zeros(leaf["shape"], dtype=torch.int64))
            counts[file][tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))] += 1
    arrays = [r for r in meta["leaves"].values() if r["kind"] == "array"]
    assert len(counts) == len(arrays)
    assert all(bool((c == 1).all()) for c in counts.values())


def test_keep_deletes_older_checkpoints_after_commit(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, {"w": torch.full((2,), float(step))}, step=step, keep=2).wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]
    assert checkpoint.restore(checkpoint.latest(tmp_path))["w"].tolist() == [4.0, 4.0]


def test_latest_ignores_unfinished_and_uncommitted(tmp_path: Path) -> None:
    assert checkpoint.latest(tmp_path / "absent") is None
    checkpoint.save(tmp_path, {"w": torch.ones(1)}, step=5).wait()
    (tmp_path / "step_9.tmp-1234").mkdir()  # a save in flight or killed
    (tmp_path / "step_7").mkdir()  # no COMMIT
    (tmp_path / "step_7" / "metadata.json").write_text("{}")
    assert checkpoint.latest(tmp_path) == tmp_path / "step_5"


def test_commit_cleans_leftovers_of_a_crashed_save_of_the_same_step(tmp_path: Path) -> None:
    (tmp_path / "step_2.tmp-dead").mkdir(parents=True)
    checkpoint.save(tmp_path, {"w": torch.ones(1)}, step=2).wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]


def test_metadata_is_json_never_pickle(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, TREE, step=1, metadata={"rng": [1, 2]}).wait()
    meta = json.loads((path / "metadata.json").read_text())
    assert meta == checkpoint.metadata(path)
    assert meta["leaves"]["odd.bf16"]["dtype"] == "bfloat16"
    assert meta["leaves"]["step"] == {"kind": "value", "value": 1}
    assert not list(path.rglob("*.pt")) and not list(path.rglob("*.pkl"))


def test_save_existing_step_is_an_error(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, {"w": torch.ones(1)}, step=1).wait()
    with pytest.raises(CheckpointExistsError, match=r"step_1' already exists; save under a new"):
        checkpoint.save(tmp_path, {"w": torch.ones(1)}, step=1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"step": -1}, ValueError, r"step must be an int >= 0, got step=-1"),
        ({"step": 1, "keep": 0}, ValueError, r"keep must be None \(keep all\) or an int >= 1"),
        ({"step": 1, "metadata": {"t": torch.ones(1)}}, TypeError, r"JSON-serializable"),
        ({"step": 1, "tree": {"f": print}}, TypeError, r"Leaf 'f' is a builtin_function"),
        (
            {"step": 1, "tree": {"m": torch.empty(2, device="meta")}},
            ValueError,
            r"'m' is on the meta",
        ),
        ({"step": 1, "tree": {"a": {"b": 1}, "a.b": 2}}, ValueError, r"Two leaves .* path 'a.b'"),
        (
            {"step": 1, "tree": {"q": torch.zeros(1, dtype=torch.float8_e4m3fnuz)}},
            TypeError,
            r"dtype torch.float8_e4m3fnuz",
        ),
    ],
)
def test_save_rejects_bad_input(tmp_path: Path, kwargs: dict, error: type, match: str) -> None:
    kwargs = {"tree": {"w": torch.ones(1)}, **kwargs}
    with pytest.raises(error, match=match):
        checkpoint.save(tmp_path, kwargs.pop("tree"), **kwargs)
    assert not list(tmp_path.iterdir())


def test_save_rejects_partial_dtensor(tmp_path: Path, one_rank_mesh) -> None:
    pending = DTensor.from_local(torch.ones(2), one_rank_mesh, [Partial()])
    with pytest.raises(ValueError, match=r"'g' is Partial on mesh axis 0: .* Reduce it first"):
        checkpoint.save(tmp_path, {"g": pending}, step=1)


def test_failed_write_raises_from_wait(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("")  # a file where the run's folder should go
    handle = checkpoint.save(tmp_path / "blocker" / "run", {"w": torch.ones(1)}, step=2)
    with pytest.raises(CheckpointSaveError, match=r"step 2 was not committed: rank 0: .*directory"):
        handle.wait()
    assert handle.done()


@pytest.mark.distributed
def test_one_rank_failing_aborts_the_commit_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from d9d.checkpoint import _commit

    write = _commit.WriteJob._write

    def flaky(job: _commit.WriteJob) -> None:
        if job.rank == 1:
            raise OSError("disk full")
        write(job)

    monkeypatch.setattr(_commit.WriteJob, "_write", flaky)

    def save() -> str:
        tree, _ = place({"w": torch.arange(8.0)}, "fsdp=2")
        try:
            checkpoint.save(tmp_path, tree, step=1).wait()
        except CheckpointSaveError as error:
            return str(error)
        return "committed"

    errors = run_on_ranks(save, 2)
    assert all("rank 1: OSError: disk full" in e for e in errors), errors
    assert checkpoint.latest(tmp_path) is None and not list(tmp_path.iterdir())


@pytest.mark.distributed
@pytest.mark.parametrize("bad", [0, 1])
def test_a_rank_failing_its_host_copy_fails_the_others_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: int
) -> None:
    """A rank whose save raised before its background half started (host OOM in the copy)
    posted nothing: the others waited the whole commit timeout (30 minutes) for it, and rank
    0's failure left the folder the others wrote into."""
    from datetime import timedelta

    from d9d.checkpoint import _commit, _save

    monkeypatch.setattr(_commit, "_COMMIT_TIMEOUT", timedelta(seconds=60))  # was the hang
    host_data = _save._host_data

    def out_of_memory(tensor: torch.Tensor, snapshot: bool) -> torch.Tensor:
        if dist.get_rank() == bad:
            raise MemoryError("host OOM")
        return host_data(tensor, snapshot)

    monkeypatch.setattr(_save, "_host_data", out_of_memory)

    def save() -> str:
        tree, _ = place({"w": torch.arange(8.0)}, "fsdp=2")
        try:
            handle = checkpoint.save(tmp_path, tree, step=1)
        except MemoryError as error:
            return f"save: {error}"
        try:
            handle.wait()
        except CheckpointSaveError as error:
            return str(error)
        return "committed"

    outcomes = run_on_ranks(save, 2)
    assert outcomes[bad] == "save: host OOM"
    other = outcomes[1 - bad]
    assert "rank 0 did not commit" in other if bad == 0 else "rank 1: MemoryError" in other
    assert "MemoryError: host OOM" in other and "timeout" not in other, other
    assert not list(tmp_path.iterdir())


def test_dtensor_with_wrong_local_shape_is_an_error(tmp_path: Path, one_rank_mesh) -> None:
    bad = DTensor.from_local(torch.ones(3), one_rank_mesh, [Shard(0)], shape=(4,), stride=(1,))
    with pytest.raises(ValueError, match=r"local shard of shape \(3,\) .* placements give \(4,\)"):
        checkpoint.save(tmp_path, {"w": bad}, step=1)
    good = distribute_tensor(torch.arange(4.0), one_rank_mesh, [Shard(0)])
    path = checkpoint.save(tmp_path, {"w": good}, step=2).wait()
    assert checkpoint.restore(path)["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert dist.get_world_size() == 1


@pytest.mark.distributed
def test_ranks_must_agree_on_step_and_leaves(tmp_path: Path) -> None:
    def save(case: str) -> str:
        rank = dist.get_rank()
        tree = {"w": torch.ones(2 + (rank if case == "leaf" else 0))}
        try:
            checkpoint.save(tmp_path, tree, step=rank if case == "step" else 1)
        except ValueError as error:
            return str(error)
        return "saved"

    assert "step=0 on rank 0 and step=1 on rank 1" in run_on_ranks(save, 2, "step")[1]
    assert "Leaf 'w' differs between ranks 0 and 1" in run_on_ranks(save, 2, "leaf")[0]


@pytest.mark.distributed
def test_target_on_a_mesh_without_this_rank_is_an_error(fsdp4_checkpoint: Path) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    def restore() -> str:
        mesh = DeviceMesh("cpu", [1], mesh_dim_names=("x",))
        if dist.get_rank() == 1:
            return "member"
        target = {"odd": {"uneven": Abstract((7, 3), torch.float32, mesh, (Shard(0),))}}
        with pytest.raises(ValueError, match=r"'odd.uneven' is on a mesh this rank is not"):
            checkpoint.restore(fsdp4_checkpoint, target, partial=True)
        return "raised"

    assert run_on_ranks(restore, 2) == ["raised", "member"]
