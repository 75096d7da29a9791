"""``d9d train`` killed with SIGKILL at random steps, five times, then resumed to the end, writes
the ``metrics.jsonl`` and losses of an uninterrupted run exactly (issue 12, item 10)."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest

from d9d import checkpoint

_ARGS = ["train", "--steps", "16", "--batch-size", "2", "--seq-len", "16", "--save-every", "3"]


def _train(argv: list[str], log: str) -> None:
    """``d9d train`` in a child process, its output in ``log``."""
    import torch

    from d9d.cli import main

    torch.set_num_threads(1)
    with open(log, "a") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        sys.exit(main(argv))


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _inode(path: Path) -> int | None:
    return path.stat().st_ino if path.exists() else None


def _logged_step(path: Path) -> int:
    """The last complete record's step (0: none)."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    complete = [line for line in lines if line.endswith("\n")]
    return json.loads(complete[-1])["step"] if complete else 0


def _kill_at(context, out: Path, step: int, log: Path) -> None:
    """Start ``d9d train --resume`` and SIGKILL it once its metrics reach ``step``."""
    metrics = out / "metrics.jsonl"
    before = _inode(metrics)  # a resume rewrites the file: records of this process only
    child = context.Process(target=_train, args=([*_ARGS, "--out", str(out), "--resume"], str(log)))
    child.start()
    deadline = time.monotonic() + 300
    while child.is_alive() and time.monotonic() < deadline:
        if _inode(metrics) not in (None, before) and _logged_step(metrics) >= step:
            break
        time.sleep(0.005)
    assert child.is_alive(), f"ended before step {step}: {log.read_text()[-2000:]}"
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL, log.read_text()[-2000:]


@pytest.mark.distributed
def test_kill_9_at_random_steps_then_resume_equals_an_uninterrupted_run(
    tmp_path: Path, fresh_processes: multiprocessing.context.ForkServerContext
) -> None:
    context = fresh_processes
    log = tmp_path / "log.txt"
    straight = context.Process(
        target=_train, args=([*_ARGS, "--out", str(tmp_path / "straight")], str(log))
    )
    straight.start()
    straight.join()
    assert straight.exitcode == 0, log.read_text()[-2000:]

    out = tmp_path / "killed"
    kills = sorted(random.Random(12).sample(range(2, 16), 5))
    for step in kills:
        _kill_at(context, out, step, log)
    last = context.Process(target=_train, args=([*_ARGS, "--out", str(out), "--resume"], str(log)))
    last.start()
    last.join()
    assert last.exitcode == 0, log.read_text()[-2000:]

    def fields(records: list[dict]) -> list[tuple]:
        return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records]

    assert fields(_records(out)) == fields(_records(tmp_path / "straight"))
    assert [r["step"] for r in _records(out)] == list(range(1, 17))
    assert [p.name for p in (out / "checkpoints").iterdir() if ".tmp-" in p.name] == []
    assert checkpoint.latest(out / "checkpoints") == out / "checkpoints" / "step_15"
    assert log.read_text().count("resumed from") >= 4, kills
