"""A SIGKILLed save leaves the previous checkpoint intact; torchrun restarts resume exactly."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from d9d import checkpoint
from d9d.checkpoint import _commit, _format
from d9d.testing import assert_trees_all_equal


def _tree(value: float) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((256, 256), value + i) for i in range(8)}


def _hang(ready: Path) -> None:
    ready.touch()
    time.sleep(60)


def _writer(directory: Path, ready: Path, stage: str) -> None:
    """Commit step 1, then start saving step 2 and hang at ``stage`` until killed."""
    torch.set_num_threads(1)
    checkpoint.save(directory, _tree(1.0), step=1).wait()
    if stage == "mid-write":  # after the first arrays' writes were issued, before the rest
        convert, calls = _commit.to_numpy, []

        def slow(tensor: torch.Tensor):
            calls.append(1)
            if len(calls) == 3:
                _hang(ready)
            return convert(tensor)

        _commit.to_numpy = slow
    else:  # every array written, the commit not yet made
        _format.commit = lambda *args: _hang(ready)
    checkpoint.save(directory, _tree(2.0), step=2).wait()


@pytest.mark.distributed
@pytest.mark.parametrize("stage", ["mid-write", "before-commit"])
def test_kill_9_during_async_save_keeps_previous_checkpoint(
    tmp_path: Path, stage: str, fresh_processes: multiprocessing.context.ForkServerContext
) -> None:
    ready = tmp_path / "ready"
    writer = fresh_processes.Process(target=_writer, args=(tmp_path / "run", ready, stage))
    writer.start()
    deadline = time.monotonic() + 30
    while not ready.exists() and writer.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(writer.pid, signal.SIGKILL)
    writer.join()
    assert writer.exitcode == -signal.SIGKILL and ready.exists()

    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names[0] == "step_1" and names[1].startswith("step_2.tmp-") and len(names) == 2
    assert checkpoint.latest(tmp_path / "run") == tmp_path / "run" / "step_1"
    restored = checkpoint.restore(tmp_path / "run" / "step_1", _tree(0.0))
    assert_trees_all_equal(restored, _tree(1.0))
    # The next save of that step commits and sweeps the dead save's folder.
    checkpoint.save(tmp_path / "run", _tree(2.0), step=2).wait()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_1", "step_2"]


@pytest.mark.distributed
def test_torchrun_restart_resumes_from_last_checkpoint(tmp_path: Path) -> None:
    script = Path(__file__).with_name("torchrun_train.py")
    result = tmp_path / "result.json"
    env = {
        **os.environ,
        # The checkout first, then what the caller's path holds.
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        str(script),
        f"--out={tmp_path / 'run'}",
        "--steps=8",
        "--save-every=2",
        "--kill-at=5",
        f"--reference-out={tmp_path / 'reference'}",
        f"--result={result}",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = json.loads(result.read_text())
    assert resumed["attempt"] == 1 and resumed["start"] == 4
    assert len(resumed["reference"]) == 8 and resumed["losses"] == resumed["reference"][4:]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_6", "step_8"]
