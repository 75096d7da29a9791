"""The documented launch, ``torchrun --max-restarts N -m d9d train ... --resume``, survives
SIGKILLed ranks: each restart resumes from the newest checkpoint and the run ends like an
uninterrupted one.

One job takes 5 kills, alternating rank 0 and rank 1, each at a random moment after the
attempt has committed a checkpoint of its own. Before ``d9d.init_process_group`` scoped the
rendezvous store to the round, a restarted gloo group read the dead attempt's addresses
from it (``connectFullMesh failed ... Connection refused``, or a hang).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from d9d.cli import main

pytestmark = pytest.mark.distributed

KILLS = 5
_ARGS = ["train", "--steps", "24", "--batch-size", "4", "--seq-len", "32", "--save-every", "2"]


def _workers(agent: int) -> dict[tuple[int, int], int]:
    """``{(attempt, rank): pid}`` of the agent's worker processes."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().split()[3]) != agent:
                continue
            pairs = (entry / "environ").read_bytes().decode().split("\0")
            env = dict(pair.split("=", 1) for pair in pairs if "=" in pair)
            found[int(env["TORCHELASTIC_RESTART_COUNT"]), int(env["RANK"])] = int(entry.name)
        except (OSError, KeyError, ValueError, IndexError):
            continue  # not a worker, or gone
    return found


def _committed(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("step_*") if ".tmp" not in p.name}


def _wait(job: subprocess.Popen, done: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + 240
    while not (found := done()):
        assert job.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} in 240 s"
        time.sleep(0.05)
    return found


def _kill_after_next_commit(job: subprocess.Popen, checkpoints: Path, attempt: int, rng) -> None:
    """SIGKILL one rank of ``attempt`` once it has committed a checkpoint of its own: the
    snapshot is taken when its workers are up, after the previous attempt's last commit."""
    rank = attempt % 2
    pid = _wait(job, lambda: _workers(job.pid).get((attempt, rank)), f"attempt {attempt}")
    before = _committed(checkpoints)
    _wait(job, lambda: _committed(checkpoints) - before, f"a commit of attempt {attempt}")
    time.sleep(rng.uniform(0.0, 0.5))
    os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds workers in /proc")
def test_killed_ranks_resume_and_end_like_one_process(tmp_path: Path) -> None:
    assert main([*_ARGS, "--out", str(tmp_path / "one")]) == 0
    out = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the default launch
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
        f"--max-restarts={KILLS}",
        "--monitor-interval=0.1",
        *("-m", "d9d", *_ARGS, "--fsdp", "2", "--resume", "--out", str(out)),
        "--dist-timeout=60",
    ]
    log = tmp_path / "log.txt"
    with log.open("w") as sink:
        job = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            rng = random.Random(0)
            for attempt in range(KILLS):
                _kill_after_next_commit(job, out / "checkpoints", attempt, rng)
            code = job.wait(timeout=300)
        finally:
            if job.poll() is None:
                job.kill()
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert text.count("resumed from") == KILLS, text[-4000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 25)), "every step logged once"
    one = [json.loads(line)["loss"] for line in (tmp_path / "one" / "metrics.jsonl").open()]
    for a, b in zip(one, (r["loss"] for r in records), strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)
