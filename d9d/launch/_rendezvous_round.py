"""A store prefix that every rank of one rendezvous round agrees on and no earlier round used.

[Note: why not the restart count] torchrun's agent keeps its store across restarts, so a
round's keys must not meet an earlier round's. ``TORCHELASTIC_RESTART_COUNT`` cannot name
the round: it is per agent and counts failures only. When a worker on one node dies, its
agent restarts with count 1, while the agents of the other nodes restart their healthy
workers for the new round without counting (count 0): the ranks scope their keys
differently and wait on each other forever (issue 23). Nothing torchelastic exports to a
worker names the round either (``TORCHELASTIC_RUN_ID`` and, with the shared store,
``MASTER_PORT`` stay the same from round to round).

What the ranks of a round do know: every worker of an earlier round was stopped before
this round's rendezvous completed, so whatever the store holds was written by the dead,
except what this round's ranks write now. So each rank draws a fresh id of its own, rank 0
also draws the round's id, and rank 0 answers each rank's id with the round's:

- rank ``r > 0`` sets ``d9d/join/<r>`` to its id and waits for ``d9d/welcome/<its id>``,
  which only a live rank 0 writes, as only a live rank 0 has read that id; it then sets
  ``d9d/round/<round id>/ready/<r>``;
- rank 0 reads ``d9d/join/*`` again and again, answers every id it has not answered yet
  (a dead rank's id too, which nobody reads), until every rank is ready under its round id.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import torch.distributed as dist

__all__ = ["round_scope"]

# Between two reads of the join keys on rank 0. The handshake takes a few reads per rank
# that is late to start; a read costs one store round trip per rank not seen yet, plus two.
_POLL_S = 0.01


def round_scope(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """The key prefix this rendezvous round's ranks share, new to ``store``.

    Every rank of the round calls it with the store of ``dist.rendezvous("env://")``.

    Args:
        store: The job's store, which may hold keys of earlier rounds of the job.
        rank: This process's rank.
        world_size: The number of ranks.
        timeout: How long to wait for rank 0 (on ranks > 0) or for the other ranks (on 0).

    Returns:
        ``"d9d/round/<id>"``, the same on every rank, with an id drawn by rank 0.

    Raises:
        TimeoutError: A rank did not take part within ``timeout``.

    Example:
        >>> store = dist.HashStore()
        >>> round_scope(store, 0, 1, timedelta(seconds=5)).startswith("d9d/round/")
        True
    """
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        scope = f"d9d/round/{uuid.uuid4().hex}"
        _welcome_every_rank(store, world_size, scope, deadline)
        return scope
    own = uuid.uuid4().hex
    store.set(f"d9d/join/{rank}", own)
    welcome = f"d9d/welcome/{own}"
    try:
        store.wait([welcome], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except dist.DistStoreError as exc:
        raise TimeoutError(
            f"rank {rank} of {world_size}: rank 0 did not answer within {timeout}; it did "
            "not start, or it hangs (look at its log), or it is in another job (check that "
            "every node has the same --rdzv-endpoint and --rdzv-id)"
        ) from exc
    scope = store.get(welcome).decode()
    store.set(f"{scope}/ready/{rank}", "")
    return scope


def _welcome_every_rank(store: dist.Store, world_size: int, scope: str, deadline: float) -> None:
    """Answer each rank's id with the round's until every rank is ready under ``scope``."""
    others = range(1, world_size)
    joins = [f"d9d/join/{r}" for r in others]
    ready = [f"{scope}/ready/{r}" for r in others]
    unseen = set(joins)  # a join key, once set, stays: each is checked until it is there
    answered: set[str] = set()
    while others and not store.check(ready):
        unseen = {key for key in unseen if not store.check([key])}
        seen = [key for key in joins if key not in unseen]
        ids = {value.decode() for value in store.multi_get(seen)} if seen else set()
        if new := sorted(ids - answered):
            store.multi_set([f"d9d/welcome/{own}" for own in new], [scope] * len(new))
            answered.update(new)
        if time.monotonic() > deadline:
            late = [r for r, key in zip(others, ready, strict=True) if not store.check([key])]
            raise TimeoutError(
                f"rank 0 of {world_size}: ranks {late} did not join this round in time; "
                "they did not start, or they hang (look at their logs)"
            )
        time.sleep(_POLL_S)
