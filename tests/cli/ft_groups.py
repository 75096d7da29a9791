"""What the tests of ``d9d train --fault-tolerant`` share: a lighthouse, waiting on a file a
replica group writes, the steps it logged, and signals to a group and every process under it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["lighthouse", "signal_all", "steps_logged", "wait_for"]


def lighthouse(min_replicas: int = 1, heartbeat_timeout_ms: int | None = None) -> Any:
    """A torchft lighthouse on a free port, its quorums formed every 50 ms, waiting up to a
    minute for a heartbeating group to ask; with ``heartbeat_timeout_ms``, a killed group
    stops counting as alive after that long (torchft's default otherwise)."""
    from torchft.coordination import LighthouseServer

    timeouts = (
        {} if heartbeat_timeout_ms is None else {"heartbeat_timeout_ms": heartbeat_timeout_ms}
    )
    return LighthouseServer(
        bind="[::]:0",
        min_replicas=min_replicas,
        join_timeout_ms=60_000,
        quorum_tick_ms=50,
        **timeouts,
    )


def wait_for(what: str, ready: Callable[[], bool], procs: list[subprocess.Popen]) -> None:
    """Poll until ``ready()`` (a file a process writes), failing early if one exits."""
    deadline = time.monotonic() + 240
    while not ready():
        dead = [p.args[-1] for p in procs if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, f"no {what}; exited: {dead}"
        time.sleep(0.05)


def steps_logged(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    # A line being written while it is read is not a whole record yet (records are flat).
    return [json.loads(line)["step"] for line in path.open() if line.rstrip().endswith("}")]


def signal_all(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to ``proc`` and every process under it (torchrun starts its workers in
    sessions of their own, which a process group signal would miss)."""
    pids = [proc.pid]
    for pid in pids:  # grows as children are found: a breadth-first walk
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):  # exited meanwhile
                pids += [int(child) for child in (task / "children").read_text().split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
