"""A rank that exits while gloo's worker threads still hold its last collectives' tensors
(``d9d/launch/_exit.py``): real ``torchrun`` ranks and interpreter exits, on one busy core."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each rank keeps its world group past destroy_process_group(), as a DeviceMesh does, and
# exits right after its last collectives on Python tensors.
RANK = """
import torch
import torch.distributed as dist
import d9d

d9d.init_process_group("gloo")
world = dist.group.WORLD
for _ in range(50):
    dist.all_reduce(torch.ones(1000))
dist.destroy_process_group()
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="pins processes to a core")
def test_ranks_exit_cleanly_right_after_their_collectives_on_a_busy_core(tmp_path: Path) -> None:
    """Without the wait at exit, a rank aborted here in 15 of 15 runs ("terminate called
    without an active exception", exit code -6)."""
    core = {min(os.sched_getaffinity(0))}

    def pin() -> None:  # in each child, before it starts: it and its children run on `core`
        os.sched_setaffinity(0, core)

    script = tmp_path / "rank.py"
    script.write_text(RANK)
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    busy = [subprocess.Popen(["sh", "-c", "while :; do :; done"], preexec_fn=pin) for _ in range(3)]
    try:
        result = subprocess.run(
            [*launch, str(script)],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
            preexec_fn=pin,
        )
    finally:
        for loop in busy:
            loop.kill()
            loop.wait()
    assert result.returncode == 0, result.stderr[-3000:]
