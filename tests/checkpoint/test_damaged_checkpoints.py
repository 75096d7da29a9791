"""A damaged newest checkpoint never hides the older ones; leftovers of dead saves are swept."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from d9d import checkpoint
from d9d.checkpoint import _format
from d9d.errors import CheckpointCorruptError, CheckpointExistsError, CheckpointSaveError


def _save(directory: Path, step: int, **kwargs) -> Path:
    return checkpoint.save(
        directory, {"w": torch.full((3,), float(step))}, step=step, **kwargs
    ).wait()


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("", r"metadata.json' is not valid JSON"),
        ('{"format": "d9d.checkpoint/1", "st', r"metadata.json' is not valid JSON"),
        ("[1, 2]", r"metadata.json' is not a d9d checkpoint's metadata: .*missing"),
        ('{"format": "d9d.checkpoint/1", "step": 2}', r"metadata.json' .*missing .*'leaves'"),
    ],
)
def test_unreadable_metadata_is_corrupt_and_latest_skips_it(
    tmp_path: Path, damage: str, match: str
) -> None:
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    (newest / "metadata.json").write_text(damage)
    with pytest.raises(CheckpointCorruptError, match=match):
        checkpoint.metadata(newest)
    with pytest.raises(CheckpointCorruptError, match=match):
        checkpoint.restore(newest, {"w": torch.zeros(3)})
    with pytest.warns(UserWarning, match=r"step_2.* skipped"):
        assert checkpoint.latest(tmp_path) == tmp_path / "step_1"
    assert checkpoint.all_checkpoints(tmp_path) == [tmp_path / "step_1", tmp_path / "step_2"]


def test_leaf_record_without_its_fields_is_corrupt(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    meta = json.loads((path / "metadata.json").read_text())
    del meta["leaves"]["w"]["shape"]
    (path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointCorruptError, match=r"metadata.json' .*leaf 'w'.*'shape'"):
        checkpoint.restore(path, {"w": torch.zeros(3)})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("shape", None),
        ("shape", [3.0]),
        ("shape", 3),
        ("dtype", "float99"),
        ("dtype", None),
        ("chunks", [3, 1]),
        ("chunks", [0]),
        ("file", None),
        ("value", [1]),
    ],
)
def test_a_leaf_field_of_the_wrong_type_is_corrupt(
    tmp_path: Path, field: str, value: object
) -> None:
    """Metadata that parses, with every field, one of a value no save writes: it escaped as a
    bare ``TypeError``/``KeyError`` from ``restore``, and ``latest`` returned it."""
    _save(tmp_path, 1)
    path = checkpoint.save(tmp_path, {"w": torch.ones(3), "n": 2}, step=2).wait()
    meta = json.loads((path / "metadata.json").read_text())
    meta["leaves"]["n" if field == "value" else "w"][field] = value
    (path / "metadata.json").write_text(json.dumps(meta))
    match = rf"metadata.json' is not a d9d .*: leaf '[wn]' has {field}={re.escape(repr(value))};"
    for target in (None, {"w": torch.zeros(3), "n": 0}):
        with pytest.raises(CheckpointCorruptError, match=match):
            checkpoint.restore(path, target)
    with pytest.warns(UserWarning, match=r"step_2.* skipped"):
        assert checkpoint.latest(tmp_path) == tmp_path / "step_1"


def test_a_leaf_pointing_at_another_leaf_s_array_is_corrupt(tmp_path: Path) -> None:
    """Two leaves of one shape and dtype whose ``file`` fields were swapped: each was
    restored, checksums and all, with the other's values."""
    path = checkpoint.save(tmp_path, {"a": torch.zeros(3), "b": torch.ones(3)}, step=1).wait()
    meta = json.loads((path / "metadata.json").read_text())
    leaves = meta["leaves"]
    leaves["a"]["file"], leaves["b"]["file"] = leaves["b"]["file"], leaves["a"]["file"]
    (path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(
        CheckpointCorruptError, match=r"leaf 'a' has file='arrays/b', not its own 'arrays/a'"
    ):
        checkpoint.restore(path, {"a": torch.zeros(3), "b": torch.zeros(3)})


def test_keep_sweeps_the_trash_of_an_interrupted_rotation(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    trash = tmp_path / "step_1.tmp-deleted-0badf00d"  # a kill mid-delete of step_1 left this
    (tmp_path / "step_1").rename(trash)
    _save(tmp_path, 2, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]


def test_keep_never_deletes_a_later_step_than_the_one_committed(tmp_path: Path) -> None:
    """Two asynchronous saves that commit out of order, or a save into a folder holding a
    later step: the rotation of the older step used to delete the newer checkpoint."""
    five = checkpoint.save(tmp_path, {"w": torch.full((3,), 5.0)}, step=5, keep=1, hold=True)
    _save(tmp_path, 6, keep=1)  # saved after step 5, committed before it
    five.commit()
    assert five.wait() == tmp_path / "step_5"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_5", "step_6"]
    assert checkpoint.latest(tmp_path) == tmp_path / "step_6"
    assert checkpoint.restore(tmp_path / "step_6")["w"].tolist() == [6.0] * 3
    _save(tmp_path, 7, keep=1)  # a later step rotates as before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_7"]


def test_a_rotation_that_fails_warns_and_the_commit_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``keep`` failing to delete an old checkpoint (EACCES) made ``wait()`` raise "failed"
    ("rank 0 did not commit" on the other ranks) for a checkpoint that was committed."""
    _save(tmp_path, 1)
    rename = os.rename

    def refuse_to_trash(src: Path, dst: Path) -> None:
        if "deleted" in str(dst):
            raise PermissionError(13, "Permission denied", str(src))
        rename(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", refuse_to_trash)
        with pytest.warns(UserWarning, match=r"step_2' is committed, but cleaning up .*step_1'"):
            assert _save(tmp_path, 2, keep=1) == tmp_path / "step_2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2"]
    assert checkpoint.restore(tmp_path / "step_1")["w"].tolist() == [1.0] * 3
    _save(tmp_path, 3, keep=1)  # the next rotation deletes both
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]


def test_sweep_removes_every_unfinished_save(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    for name in ("step_1.tmp-aaaa", "step_7.tmp-bbbb", "step_3.tmp-deleted-cccc"):
        (tmp_path / name / "arrays").mkdir(parents=True)
    removed = checkpoint.sweep(tmp_path)
    assert sorted(p.name for p in removed) == [
        "step_1.tmp-aaaa",
        "step_3.tmp-deleted-cccc",
        "step_7.tmp-bbbb",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    assert checkpoint.sweep(tmp_path / "absent") == []


def test_sweep_keeps_the_folder_of_a_save_in_flight(tmp_path: Path) -> None:
    """A run that starts while the one it replaces still commits its last checkpoint (a
    preempted pod's successor) must not delete that checkpoint under it."""
    from d9d.checkpoint import _claim

    writing = tmp_path / "step_4.tmp-live"
    claim = _claim.claim(writing)
    (tmp_path / "step_2.tmp-dead").mkdir()
    assert [p.name for p in checkpoint.sweep(tmp_path)] == ["step_2.tmp-dead"]
    assert writing.is_dir()
    claim.release()
    assert [p.name for p in checkpoint.sweep(tmp_path)] == ["step_4.tmp-live"]


def test_two_saves_of_one_step_leave_no_tmp_folder(tmp_path: Path) -> None:
    handles = [checkpoint.save(tmp_path, {"w": torch.ones(3)}, step=4)]
    with contextlib.suppress(CheckpointExistsError):  # the first one committed already
        handles.append(checkpoint.save(tmp_path, {"w": torch.ones(3)}, step=4))
    outcomes = []
    for handle in handles:
        try:
            outcomes.append(handle.wait().name)
        except CheckpointSaveError as error:
            outcomes.append(str(error))
    assert outcomes.count("step_4") == 1
    for outcome in outcomes:
        assert outcome == "step_4" or re.search(r"step_4' is already committed", outcome)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4"]


def test_a_held_save_commits_only_when_told(tmp_path: Path) -> None:
    held = checkpoint.save(tmp_path, {"w": torch.ones(3)}, step=1, hold=True)
    with pytest.raises(RuntimeError, match=r"step 1 is held: call commit\(\) or discard\(\)"):
        held.wait()
    assert checkpoint.latest(tmp_path) is None
    held.commit()
    assert held.wait() == tmp_path / "step_1"
    dropped = checkpoint.save(tmp_path, {"w": torch.ones(3)}, step=2, hold=True, keep=1)
    dropped.discard()
    assert dropped.wait() is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]  # keep deleted nothing
    with pytest.raises(ValueError, match="hold=True needs async_=True"):
        checkpoint.save(tmp_path, {"w": torch.ones(3)}, step=3, hold=True, async_=False)


_HELD_THEN_CRASH = """
import sys, torch
from d9d import checkpoint
checkpoint.save(sys.argv[1], {"w": torch.ones(3)}, step=1)
checkpoint.save(sys.argv[1], {"w": torch.ones(3)}, step=2, hold=True)
raise RuntimeError("the training loop crashed")
"""


def test_a_program_that_ends_holding_a_save_exits_and_drops_it(tmp_path: Path) -> None:
    """The held save's thread waited for commit() or discard() for ever, so a program that
    crashed with one held never exited (under torchrun: a hung rank, not a failed one)."""
    done = subprocess.run(
        [sys.executable, "-c", _HELD_THEN_CRASH, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,  # the hang this guards against
    )
    assert done.returncode == 1 and "the training loop crashed" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]  # step 2 dropped


def test_a_save_that_commits_between_the_check_and_the_rename_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other save renames its folder after this one found no ``step_4``: the rename then
    fails (ENOTEMPTY on Linux), which means the same as the check would have."""
    final, tmp = tmp_path / "step_4", tmp_path / "step_4.tmp-mine"
    (final / "data").mkdir(parents=True)
    tmp.mkdir()
    monkeypatch.setattr(
        Path, "exists", lambda self: False if self == final else os.path.lexists(self)
    )
    with pytest.raises(CheckpointExistsError, match=r"step_4' is already committed by another"):
        _format.commit(tmp, final, {"step": 4})
    assert (final / "data").is_dir() and tmp.is_dir()


def test_a_rotation_never_removes_the_folder_of_a_save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CI failure, forced: save B of step 4 has written its metadata and is about to write
    ``COMMIT`` when save A of step 4 commits and rotates. A's rotation used to remove B's
    folder, and B failed with ``FileNotFoundError: .../step_4.tmp-.../COMMIT``."""
    write_synced, paused, resume = _format._write_synced, threading.Event(), threading.Event()

    def pause_after_the_first_metadata(path: Path, text: str) -> None:
        write_synced(path, text)
        if path.name == "metadata.json" and not paused.is_set():
            paused.set()
            assert resume.wait(60)

    monkeypatch.setattr(_format, "_write_synced", pause_after_the_first_metadata)
    b = checkpoint.save(tmp_path, {"w": torch.ones(3)}, step=4)  # its thread pauses in commit
    assert paused.wait(60)
    (b_folder,) = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    a = checkpoint.save(tmp_path, {"w": torch.zeros(3)}, step=4, async_=False)
    assert a.path == tmp_path / "step_4"
    assert b_folder.is_dir(), "the rotation removed a save in flight"
    resume.set()
    with pytest.raises(CheckpointSaveError, match=r"step_4' is already committed by another"):
        b.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4"]
    assert checkpoint.restore(tmp_path / "step_4", {"w": torch.ones(3)})["w"].eq(0).all()
