"""The round scope: every rank of a round gets the same prefix, new to a store that holds
earlier rounds' keys, whatever order the ranks start in and whatever a dead round left."""

from __future__ import annotations

import doctest
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from d9d.launch import _rendezvous_round
from d9d.launch._rendezvous_round import round_scope

pytestmark = pytest.mark.distributed

TIMEOUT = timedelta(seconds=60)


@pytest.fixture
def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=TIMEOUT)


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, None, is_master=False, timeout=TIMEOUT)


def _round(server: dist.TCPStore, world: int, first: tuple[int, ...] = ()) -> list[str]:
    """Each rank's scope; the ``first`` ranks start before the others, and those above 0 have
    set their ids before the others start."""
    stores = {rank: _client(server) for rank in range(world)}
    before = {rank: _join(server, rank) for rank in first}

    def scope(rank: int) -> str:
        return round_scope(stores[rank], rank, world, TIMEOUT)

    with ThreadPoolExecutor(world) as pool:
        futures = {rank: pool.submit(scope, rank) for rank in first}
        for rank in first:
            while rank > 0 and _join(server, rank) == before[rank]:  # its id: an event
                time.sleep(0.01)
        for rank in range(world):
            if rank not in first:
                futures[rank] = pool.submit(scope, rank)
        return [futures[rank].result(timeout=120) for rank in range(world)]


def _join(store: dist.Store, rank: int) -> bytes:
    key = f"d9d/join/{rank}"
    return store.get(key) if store.check([key]) else b""


def test_every_rank_gets_one_new_scope_per_round(server: dist.TCPStore) -> None:
    seen = set()
    for first in ((), (0,), (1, 2), (2,), (0, 2)):
        scopes = _round(server, 3, first)
        assert len(set(scopes)) == 1, scopes
        assert scopes[0] not in seen, "a round reused an earlier round's scope"
        seen.add(scopes[0])


def test_a_dead_rounds_unanswered_ids_do_not_mislead(server: dist.TCPStore) -> None:
    """A round whose rank 0 died before answering left ids that nobody answered, and a
    welcome that was never read: the next round still agrees on a new scope."""
    server.set("d9d/join/1", "dead-1")
    server.set("d9d/join/2", "dead-2")
    server.set("d9d/welcome/dead-2", "d9d/round/dead")
    scopes = _round(server, 3, first=(2,))
    assert len(set(scopes)) == 1 and scopes[0] != "d9d/round/dead", scopes


def test_rank_0_names_the_ranks_that_never_came(server: dist.TCPStore) -> None:
    with pytest.raises(TimeoutError, match=r"rank 0 of 3: ranks \[1, 2\] did not join"):
        round_scope(_client(server), 0, 3, timedelta(seconds=0.2))


def test_a_rank_says_when_rank_0_never_answers(server: dist.TCPStore) -> None:
    with pytest.raises(TimeoutError, match="rank 1 of 2: rank 0 did not answer within"):
        round_scope(_client(server), 1, 2, timedelta(seconds=0.2))


def test_the_docstring_example_runs() -> None:
    assert doctest.testmod(_rendezvous_round).failed == 0
