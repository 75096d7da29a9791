"""The documented multi-node launch, one ``torchrun --nnodes 2`` agent per node with a c10d
rendezvous, survives SIGKILLed ranks on either node and ends like one process.

Two agents on this host stand for two nodes. Each round, once a checkpoint of its own is
committed, the worker of one node is killed, the nodes in turn, 5 times. The node whose
worker died restarts it as a failure; the other node's agent restarts its healthy worker
to join the new round without counting one, so the nodes' ``TORCHELASTIC_RESTART_COUNT``
differ. Before ``d9d.init_process_group`` scoped the store by an id the round agrees on,
the new workers waited on each other forever in ``init_process_group``, with the agent's
store shared (the default) or with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from d9d.cli import main

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds workers in /proc"),
]

KILLS = 5
DEADLINE_S = 420  # for the whole job: 221 s seen beside a load average of 20 on 2 cores
STEPS = 30
_ARGS = ["train", "--steps", str(STEPS), "--batch-size", "4", "--seq-len", "32"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    out = tmp_path_factory.mktemp("one")
    assert main([*_ARGS, "--out", str(out)]) == 0  # no checkpoints: they change no loss
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").open()]


class _Job:
    """Two ``torchrun --nnodes 2`` agents, node 0 hosting the rendezvous, with a deadline."""

    def __init__(self, out: Path, logs: Path, env: dict[str, str]) -> None:
        port = _free_port()
        logs.mkdir()
        self.logs = [logs / f"node{node}.txt" for node in range(2)]
        self.deadline = time.monotonic() + DEADLINE_S
        self.agents = []
        run_id = uuid.uuid4().hex
        for node, log in enumerate(self.logs):
            command = [
                *(sys.executable, "-m", "torch.distributed.run"),
                *("--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d"),
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id={run_id}",
                f"--rdzv-conf=is_host={int(node == 0)}",
                f"--max-restarts={KILLS}",
                "--monitor-interval=0.1",
                *("-m", "d9d", *_ARGS, "--save-every=2", "--fsdp=2", "--resume", f"--out={out}"),
                "--dist-timeout=180",
            ]
            with log.open("w") as sink:
                self.agents.append(
                    subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
                )

    def wait_for(self, found: Callable[[], Any], what: str) -> Any:
        while not (value := found()):
            for node, agent in enumerate(self.agents):
                if agent.poll() is not None:
                    raise _AgentEnded(f"node {node} ended before {what}:\n{self.tail()}")
            assert time.monotonic() < self.deadline, f"no {what} in {DEADLINE_S} s:\n{self.tail()}"
            time.sleep(0.05)
        return value

    def new_workers(self, old: set[_Process]) -> dict[int, _Process]:
        """Each node's worker that is not in ``old``, once both nodes have one."""
        new = {n: set(_children(agent.pid)) - old for n, agent in enumerate(self.agents)}
        return {n: found.pop() for n, found in new.items()} if all(new.values()) else {}

    def stop(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                for worker in _children(agent.pid):
                    _kill(worker)
                agent.kill()
            agent.wait()

    def tail(self) -> str:
        logs = enumerate(self.logs)
        return "\n".join(f"--- node {n}:\n{log.read_text()[-3000:]}" for n, log in logs)


class _AgentEnded(AssertionError):
    pass


def _started(out: Path, folder: Path, env: dict[str, str]) -> tuple[_Job, dict[int, _Process]]:
    """A job and its first round's worker on each node. Were the rendezvous port taken
    between picking and binding it, node 0's agent (``is_host=1``) exits at once, never joining
    another store: the job is started again on another port."""
    for attempt in range(3):
        job = _Job(out, folder / f"start{attempt}", env)
        try:
            return job, job.wait_for(partial(job.new_workers, set()), "round 0's workers")
        except _AgentEnded:
            job.stop()
    raise AssertionError(f"the job did not start in 3 tries:\n{job.tail()}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Process(NamedTuple):
    pid: int
    start: int  # clock ticks after boot: with the pid, names the process (pids are reused)


def _stat(pid: int) -> list[str]:
    """``/proc/PID/stat`` from its third field (``state``) on: ``[1]`` the parent, ``[19]``
    the start time."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _children(parent: int) -> list[_Process]:
    """The worker processes ``parent`` (an agent) started."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = _stat(int(entry.name))
            if (
                int(stat[1]) == parent
                and b"TORCHELASTIC_RUN_ID=" in (entry / "environ").read_bytes()
            ):
                found.append(_Process(int(entry.name), int(stat[19])))
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone
    return found


def _kill(worker: _Process) -> None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        if int(_stat(worker.pid)[19]) == worker.start:  # not a process that reused its pid
            os.kill(worker.pid, signal.SIGKILL)


def _committed(folder: Path, before: frozenset[str] = frozenset()) -> set[str]:
    """The checkpoints committed in ``folder``, less those ``before``."""
    return {p.name for p in folder.glob("step_*") if ".tmp" not in p.name} - before


@pytest.mark.parametrize("share", ["agent-store", "store-per-round"])
def test_ranks_killed_on_either_node_resume_and_end_like_one_process(
    tmp_path: Path, share: str, one_process: list[float]
) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if share == "store-per-round":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    rng = random.Random(0)
    job, workers = _started(out, tmp_path, env)
    try:
        old = set(workers.values())  # workers of this and earlier rounds
        for kill in range(KILLS):
            if kill:
                # This round's workers: new on both nodes (the old ones were stopped before
                # the round's rendezvous completed, so a commit from now on is this round's).
                workers = job.wait_for(partial(job.new_workers, old), f"round {kill}'s workers")
                old |= set(workers.values())
            before = frozenset(_committed(out / "checkpoints"))
            job.wait_for(partial(_committed, out / "checkpoints", before), f"round {kill}'s commit")
            time.sleep(rng.uniform(0.0, 0.3))  # not a wait: where in the step the kill lands
            _kill(workers[kill % 2])
        remaining = max(job.deadline - time.monotonic(), 1)
        codes = [agent.wait(timeout=remaining) for agent in job.agents]
    finally:
        job.stop()
    text = job.tail()
    assert codes == [0, 0], text
    resumed = sum(log.read_text().count("resumed from") for log in job.logs)
    assert resumed == KILLS, text
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "every step logged once"
    for a, b in zip(one_process, (r["loss"] for r in records), strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)
