"""A rotation removes a ``.tmp-`` folder only when no live save claims it (issue 23, item 4)."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from d9d import checkpoint
from d9d.checkpoint import _claim, _format

_HOLD = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('locked', flush=True)\n"
    "time.sleep(120)\n"
)


def test_a_commit_removes_dead_saves_of_its_step_but_not_another_process_s_live_one(
    tmp_path: Path,
) -> None:
    dead, live = tmp_path / "step_4.tmp-0dead000", tmp_path / "step_4.tmp-11fe0000"
    for folder in (dead, live):
        (folder / "arrays").mkdir(parents=True)
    owner = subprocess.Popen([sys.executable, "-c", _HOLD, str(live)], stdout=subprocess.PIPE)
    try:
        assert owner.stdout.readline() == b"locked\n"
        checkpoint.save(tmp_path, {"w": torch.ones(3)}, step=4).wait()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", live.name]
    finally:
        owner.kill()
        owner.wait()
    _format.rotate(tmp_path, 4, None)  # its owner died: now it is provably abandoned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4"]


def test_a_claim_taken_while_a_rotation_removes_the_folder_makes_it_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The saver opened its new folder, and a rotation took and removed it before the saver
    locked it: the saver's lock is then on a removed folder, so it makes and locks a new one."""
    folder = tmp_path / "step_4.tmp-0000beef"
    folder.mkdir()
    rotation = _claim.abandoned(folder)
    assert rotation is not None
    flock, waiting = fcntl.flock, threading.Event()

    def signal_then_flock(fd: int, operation: int) -> None:
        waiting.set()
        flock(fd, operation)

    monkeypatch.setattr(_claim.fcntl, "flock", signal_then_flock)
    claims: list[_claim.Claim] = []
    saver = threading.Thread(target=lambda: claims.append(_claim.claim(folder)))
    saver.start()
    assert waiting.wait(60)
    shutil.rmtree(folder)
    rotation.release()
    saver.join(60)
    monkeypatch.undo()
    assert folder.is_dir() and _claim.abandoned(folder) is None  # a new folder, held
    claims[0].release()
    held = _claim.abandoned(folder)
    assert held is not None
    held.release()


def test_two_rotations_of_one_checkpoint_do_not_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another save's rotation renamed an old checkpoint away between this rotation's listing
    and its rename."""
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, {"w": torch.ones(1)}, step=step).wait()
    listed = _format._committed(tmp_path)
    monkeypatch.setattr(
        _format, "_committed", lambda directory: [(0, tmp_path / "step_0"), *listed]
    )
    _format.rotate(tmp_path, 3, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]
