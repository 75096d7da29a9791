"""``d9d train`` under a real ``torchrun`` with 2 gloo ranks equals the single-process run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from d9d._cli import main

pytestmark = pytest.mark.distributed

_ARGS = ["train", "--steps", "4", "--batch-size", "4", "--seq-len", "32"]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_train_like_one_and_resume_on_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*_ARGS, "--out", str(tmp_path / "one")]) == 0
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    env = {
        **os.environ,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",  # a crashing rank prints every thread's stack
    }
    result = subprocess.run(
        [
            *command,
            "-m",
            "d9d",
            *_ARGS,
            "--fsdp",
            "2",
            "--save-every",
            "2",
            "--out",
            str(tmp_path / "two"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert result.stdout.count("wrote") == 1, "only rank 0 reports"
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(two) == 4
    for a, b in zip(one, two, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)
    # The 2-rank checkpoint of step 2 resumes in one process: resharded, RNG reset.
    shutil.rmtree(tmp_path / "two" / "checkpoints" / "step_4")
    capsys.readouterr()
    assert main([*_ARGS, "--out", str(tmp_path / "two"), "--resume"]) == 0
    assert "step_2' was saved by 2 ranks and this run has 1" in capsys.readouterr().err
    for a, b in zip(one, _losses(tmp_path / "two"), strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)


def test_mesh_must_match_the_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_ARGS, "--fsdp", "2", "--out", str(tmp_path)]) == 2
    assert "--dp/--fsdp/--tp/--cp/--pp need several ranks: launch with `torchrun" in (
        capsys.readouterr().err
    )


def test_a_killed_rank_restarts_and_resumes_under_plain_torchrun(tmp_path: Path) -> None:
    """The documented launch, without TORCH_DISABLE_SHARE_RDZV_TCP_STORE: torchrun's shared
    store would hand the restarted ranks the dead attempt's keys (d9d/_train_group.py)."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("--max-restarts", "1", "--monitor-interval", "0.1", "-m", "d9d", *_ARGS),
        *("--steps", "6", "--fsdp", "2", "--save-every", "2", "--resume", "--out", str(out)),
    ]
    agent = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while agent.poll() is None and time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.02)
        workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True)
        os.kill(max(map(int, workers.stdout.split())), signal.SIGKILL)
        output = agent.communicate(timeout=240)[0].decode()
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, output[-3000:]
    assert "resumed from" in output
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(
        range(1, 7)
    )
