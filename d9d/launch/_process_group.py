"""Joining a ``torchrun`` job so that a restarted round never meets the dead one's keys.

[Note: the store shared across restarts] ``torchrun``'s c10d rendezvous hosts one TCPStore in
the agent and, by default, hands it to the workers of every round
(``TORCHELASTIC_USE_AGENT_STORE``).
``init_process_group`` prefixes its keys with ``default_pg`` only, so after a restart the new
workers find the dead round's keys still there: gloo reads a dead peer's address and fails
``connectFullMesh ... Connection refused`` or waits on it (pytorch/pytorch#135712).
:func:`init_process_group` prefixes the store with an id the round's ranks agree on
(``_rendezvous_round.py`` says how, and why the restart count cannot be it).
"""

from __future__ import annotations

import faulthandler
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ._exit import wait_at_exit_for_collective_threads
from ._rendezvous_round import round_scope

__all__ = ["init_process_group"]


def init_process_group(
    backend: str | None = None, *, timeout: timedelta = timedelta(minutes=10)
) -> None:
    """Join the job ``torchrun`` started this process in, safely across restarts.

    Like ``torch.distributed.init_process_group()`` with the ``env://`` rendezvous torchrun
    sets up (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), except that the
    store's keys are scoped to the rendezvous round (an id rank 0 draws and hands to every
    rank), so a job restarted by ``torchrun --max-restarts N`` after a rank died starts
    cleanly, on one node or many, and that every store wait and collective gives up after
    ``timeout`` with an error instead of hanging.
    On CUDA it also selects the device of ``LOCAL_RANK``. It turns ``faulthandler`` on, so
    that a rank killed by a fatal signal (SIGSEGV, SIGABRT from C++'s ``std::terminate``)
    prints every thread's Python stack to stderr, where torchrun's report says only the signal,
    and makes the process wait at exit until gloo's worker threads have let go of the tensors
    of the last collectives (``_exit.py``: otherwise a rank can abort at exit under load).

    Args:
        backend: ``"nccl"``, ``"gloo"``, ... (default: NCCL with CUDA, else gloo).
        timeout: How long a collective or store wait may block (default 10 minutes).

    Raises:
        ValueError: The process was not started by ``torchrun`` (no ``RANK`` set), or a
            variable of the ``env://`` rendezvous is missing (``WORLD_SIZE``, ``MASTER_ADDR``,
            ``MASTER_PORT``).
        TimeoutError: A rank did not join within ``timeout``.
        ConnectionError: The store at ``MASTER_ADDR:MASTER_PORT`` could not be reached (or,
            on the rank that serves it, not opened); the message names both variables.

    Example:
        >>> import d9d
        >>> # in a script run by `torchrun --nproc-per-node 8 script.py`:
        >>> d9d.init_process_group()  # doctest: +SKIP
    """
    if "RANK" not in os.environ:
        raise ValueError(
            "d9d.init_process_group joins a torchrun job, but RANK is not set: launch with "
            "`torchrun --nproc-per-node N script.py`"
        )
    faulthandler.enable(all_threads=True)
    wait_at_exit_for_collective_threads()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    store, rank, world = _rendezvous(timeout)
    store.set_timeout(timeout)
    store = dist.PrefixStore(round_scope(store, rank, world, timeout), store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _rendezvous(timeout: timedelta) -> tuple[dist.Store, int, int]:
    """``dist.rendezvous("env://")``, whose failures name the variables to check.

    torch says only ``DistNetworkError: The client socket has timed out ... (10.0.0.1, 29500)``
    or ``DistStoreError: Timed out after 601 seconds waiting for clients. 1/2 clients
    joined.``, which name neither ``MASTER_ADDR``, ``MASTER_PORT`` nor ``WORLD_SIZE``: what a
    user launching without torchrun (or with a wrong ``--master-addr``) has to fix.
    """
    try:
        return next(dist.rendezvous("env://", timeout=timeout))
    except dist.DistError as error:
        rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        where = f"MASTER_ADDR={addr} MASTER_PORT={port}"
        said = " ".join(str(error).split())
        if isinstance(error, dist.DistStoreError):  # the serving rank waited for the others
            raise TimeoutError(
                f"rank {rank} of WORLD_SIZE={world} served the job's store at {where}, and not "
                f"every rank reached it within {timeout} ({said}): start WORLD_SIZE ranks, each "
                "with this MASTER_ADDR (an address of this host that theirs can reach) and "
                "MASTER_PORT, or launch with torchrun, which sets them"
            ) from error
        raise ConnectionError(
            f"rank {rank} of WORLD_SIZE={world} could not reach (rank 0: open) the job's store "
            f"at {where} within {timeout} ({said}): set MASTER_ADDR to the host of rank 0, reachable from "
            "this one, and MASTER_PORT to a free port there, the same on every rank (torchrun "
            "sets both from --master-addr/--master-port or --rdzv-endpoint)"
        ) from error
