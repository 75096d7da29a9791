"""``d9d train`` under a real ``torchrun`` with 2 gloo ranks equals the single-process run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from d9d.cli import main

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
    [device] = [line for line in result.stdout.splitlines() if line.startswith("device ")]
    assert device.endswith(" per rank, 2 ranks: fsdp=2"), "rank 0's header shows the mesh"
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
    assert "--dp/--fsdp/--ep/--tp/--cp/--pp need several ranks: launch with `torchrun" in (
        capsys.readouterr().err
    )
