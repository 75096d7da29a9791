"""``d9d.init_process_group`` outside torchrun, and two rounds of workers on one agent
store (a real torchrun with restarts: tests/cli/test_train_restarts.py and
tests/cli/test_train_multinode.py)."""

from __future__ import annotations

import multiprocessing
import os
import socket
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import d9d


def test_outside_torchrun_it_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match=r"RANK is not set: launch with `torchrun"):
        d9d.init_process_group()


def _closed_port() -> int:
    """A port of this host that nothing listens on (bound, then let go)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("rank", ["0", "1"], ids=["serving-rank", "client-rank"])
def test_a_store_nobody_reaches_names_master_addr_and_port(
    monkeypatch: pytest.MonkeyPatch, rank: str
) -> None:
    """torch's own errors (``DistNetworkError: The client socket has timed out ...``,
    ``DistStoreError: ... 1/2 clients joined``) named no variable to fix, and were not the
    ``TimeoutError`` the docstring promised; both stop within the timeout."""
    port = str(_closed_port())
    env = {"RANK": rank, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    expected = TimeoutError if rank == "0" else ConnectionError
    with pytest.raises(expected) as caught:
        d9d.init_process_group("gloo", timeout=timedelta(seconds=1))
    message = str(caught.value)
    assert f"rank {rank} of WORLD_SIZE=2" in message
    assert f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}" in message
    assert not dist.is_initialized()


def _worker(env: dict[str, str], results: Any) -> None:
    """One torchrun worker: join, sum the ranks, see whether an earlier round's key shows."""
    os.environ.update(env)
    d9d.init_process_group("gloo", timeout=timedelta(seconds=20))
    try:
        total = torch.tensor([int(env["RANK"]) + 1])
        dist.all_reduce(total)
        store = dist.distributed_c10d._get_default_store()
        seen = store.check(["left by round 1"])
        dist.barrier()
        store.set("left by round 1", "x")
        results.put((int(env["RANK"]), int(total), seen))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_ranks_restarted_different_times_join_one_new_round(
    fresh_processes: multiprocessing.context.ForkServerContext,
) -> None:
    """torchrun's agent store outlives a round, and each agent counts only its own failures:
    the second round's rank 0 comes from a node whose worker died (restart count 1), rank 1
    from a node that was only asked to join the new round (count 0). They join one group
    and see nothing of the first round's keys."""
    agent = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    for counts in (("0", "0"), ("1", "0")):
        results = fresh_processes.Queue()
        workers = []
        for rank, count in enumerate(counts):
            env = {
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": count,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(agent.port),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
            }
            workers.append(fresh_processes.Process(target=_worker, args=(env, results)))
        for worker in workers:
            worker.start()
        try:
            got = sorted(results.get(timeout=60) for _ in workers)
        finally:
            for worker in workers:
                worker.join(timeout=30)
                if worker.is_alive():
                    worker.kill()
        assert got == [(0, 3, False), (1, 3, False)], f"restart counts {counts}: {got}"
        assert [worker.exitcode for worker in workers] == [0, 0]
