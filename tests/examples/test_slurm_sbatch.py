"""examples/slurm/train.sbatch runs, with ``srun`` and ``scontrol`` stubbed, the command
docs/train.md documents: one torchrun agent per node, a c10d rendezvous on the first node,
the job's id as the rendezvous id, and ``d9d train ... --resume`` with the user's arguments;
torchrun's parser and d9d's accept it. (tests/cli/test_train_multinode.py runs that command
on two agents, killing ranks.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from torch.distributed.run import get_args_parser

from d9d.cli._main import _parser

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"

# What the stubs see: scontrol expands the node list, srun records its arguments.
_SCONTROL = """#!/usr/bin/env bash
[ "$*" = "show hostnames gpu-[07-08]" ] || { echo "scontrol: unexpected $*" >&2; exit 2; }
printf 'gpu-07\\ngpu-08\\n'
"""
_SRUN = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["SRUN_CALLS"], "a") as calls:
    calls.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def _sbatch(tmp_path: Path, *args: str, **env: str) -> list[list[str]]:
    """The srun calls of the script run as Slurm would on a 2-node allocation."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in {"scontrol": _SCONTROL, "srun": _SRUN}.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    slurm = {
        "SLURM_JOB_NODELIST": "gpu-[07-08]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "d9d-train",
    }
    done = subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={
            **os.environ,
            **slurm,
            **env,
            "PATH": f"{stubs}:{os.environ['PATH']}",
            "SRUN_CALLS": str(calls),
        },
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in calls.read_text().splitlines()]


def test_one_agent_per_node_meets_on_the_first_node(tmp_path: Path) -> None:
    [call] = _sbatch(tmp_path, "--preset", "1b", "--fsdp", "16")
    assert call == [
        *("--ntasks-per-node=1", "--kill-on-bad-exit=1", "torchrun"),
        *("--nnodes=2", "--nproc-per-node=gpu", "--rdzv-backend=c10d"),
        *("--rdzv-endpoint=gpu-07:29400", "--rdzv-id=4242", "--max-restarts=3"),
        *("-m", "d9d", "train", "--save-every", "200", "--resume", "--out", "runs/d9d-train"),
        *("--preset", "1b", "--fsdp", "16"),
    ]
    torchrun = get_args_parser().parse_args(call[call.index("torchrun") + 1 :])
    assert (torchrun.nnodes, torchrun.rdzv_endpoint, torchrun.module) == ("2", "gpu-07:29400", True)
    train = _parser().parse_args(torchrun.training_script_args)
    assert (train.command, train.resume, train.save_every, train.fsdp) == ("train", True, 200, 16)


def test_the_variables_at_its_top_set_what_they_name(tmp_path: Path) -> None:
    [call] = _sbatch(
        tmp_path,
        OUT="/shared/runs/a",
        SAVE_EVERY="50",
        MAX_RESTARTS="5",
        RDZV_PORT="29500",
        NPROC_PER_NODE="4",
    )
    for flag in ("--nproc-per-node=4", "--rdzv-endpoint=gpu-07:29500", "--max-restarts=5"):
        assert flag in call
    assert call[-5:] == ["--save-every", "50", "--resume", "--out", "/shared/runs/a"]


def test_outside_a_slurm_job_it_says_so_and_starts_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "this script runs inside a Slurm job: submit it with sbatch" in done.stderr
