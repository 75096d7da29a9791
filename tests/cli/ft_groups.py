"""What the tests of ``d9d train --fault-tolerant`` share: a lighthouse, waiting on a file a
replica group writes, the steps it logged, and signals to a group and every process under it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "kill_and_restart",
    "lighthouse",
    "signal_all",
    "start_group",
    "steps_logged",
    "wait_for",
]


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


def start_group(command: list[str], lighthouse: Any, group: int, out: Path, log: Path) -> Any:
    """``command`` (a ``d9d train`` launch) as replica group ``group`` of 2 on ``lighthouse``,
    writing into ``out``; its output into the file ``log`` (a pipe nobody reads while the
    test waits fills with torchft's log lines and stops its writer)."""
    return subprocess.Popen(
        [
            *(*command, "--fault-tolerant", f"--lighthouse={lighthouse.address()}"),
            *("--replica-groups=2", f"--replica-group-id={group}", f"--out={out}"),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def kill_and_restart(
    start: Callable[[int, str], subprocess.Popen],
    lighthouse: Any,
    what: str,
    ready: Callable[[], bool],
) -> list[int]:
    """Start groups 0 and 1 (``start(group, log name)``: ``group0.log``, ``group1.log``),
    SIGKILL group 1 and every process under it once ``ready()``, start it again
    (``group1b.log``), and return the exit codes of group 0 and the restarted group; what is
    still running at the end is killed, and the lighthouse shut down."""
    procs: list[subprocess.Popen] = []
    try:
        survivor, victim = start(0, "group0.log"), start(1, "group1.log")
        procs = [survivor, victim]
        wait_for(what, ready, procs)
        signal_all(victim, signal.SIGKILL)
        assert victim.wait(timeout=60) == -signal.SIGKILL
        restarted = start(1, "group1b.log")
        procs = [survivor, restarted]
        return [survivor.wait(timeout=240), restarted.wait(timeout=240)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                signal_all(proc, signal.SIGKILL)
        lighthouse.shutdown()
