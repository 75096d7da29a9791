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
        ValueError: The process was not started by ``torchrun`` (no ``RANK`` set).
        TimeoutError: A rank did not join within ``timeout``.

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
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(round_scope(store, rank, world, timeout), store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
