"""A rank that exits while gloo's worker threads still hold its last collectives' tensors
(``d9d/launch/_exit.py``): real ``torchrun`` ranks and interpreter exits, on one busy core."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each rank keeps its world group past destroy_process_group(), as a DeviceMesh does, and
# exits right after its last collectives on Python tensors. Its gloo workers run at the lowest
# priority (nice 19 beside busy loops of nice 0): each lags the main thread after a collective,
# as one does now and then on a loaded machine.
RANK = """
import os
import torch
import torch.distributed as dist
import d9d

d9d.init_process_group("gloo")
world = dist.group.WORLD
for task in os.scandir("/proc/self/task"):
    with open(f"{task.path}/comm") as comm:
        if comm.read().strip() == "pt_gloo_runloop":
            os.setpriority(os.PRIO_PROCESS, int(task.name), 19)
for _ in range(10):
    dist.all_reduce(torch.ones(1000))
dist.destroy_process_group()
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="pins processes to a core")
def test_ranks_exit_cleanly_right_after_their_collectives_on_a_busy_core(tmp_path: Path) -> None:
    """Two torchrun jobs of two ranks at once. Without the wait at exit, each of 6 runs of
    this test had a rank abort ("terminate called without an active exception", exit code
    -6), and 5 of 10 jobs did; with it, none of 10 jobs did."""
    core = min(os.sched_getaffinity(0))
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    # torchrun, its agent and its ranks on `core` from their start (a Python that pins itself,
    # then execs torchrun: no preexec_fn, which may deadlock in a process with threads).
    pinned = (
        f"import os, sys; os.sched_setaffinity(0, {{{core}}}); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    launch = [sys.executable, "-c", pinned, "-m", "torch.distributed.run", "--standalone"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    busy = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(3)]
    jobs: list[subprocess.Popen] = []
    try:
        for loop in busy:
            os.sched_setaffinity(loop.pid, {core})
        logs = [tmp_path / f"job{j}.log" for j in range(2)]
        jobs = [
            subprocess.Popen(
                [*launch, "--nproc-per-node=2", str(script)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log.open("w"),  # a file: a pipe nobody reads could fill
            )
            for log in logs
        ]
        codes = [job.wait(timeout=240) for job in jobs]
    finally:
        for process in [*busy, *jobs]:
            process.kill()
            process.wait()
    for code, log in zip(codes, logs, strict=True):
        assert code == 0, log.read_text()[-3000:]
