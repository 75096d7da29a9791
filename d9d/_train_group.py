"""The process group of a ``d9d train`` rank under ``torchrun``, safe across restarts.

[Note: torchrun's shared store] Since torch 2.4 torchrun's agent shares its rendezvous
TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``) and keeps it across
restarts, while ``init_process_group`` puts the default group's keys under the same names in
every attempt (``default_pg/0/...``; torch assumes a fresh store per attempt). After a rank is
killed, the restarted ranks can read the dead attempt's keys: gloo connects to the dead
ranks' addresses (``Gloo connectFullMesh failed``) or a store barrier counts the old arrivals
and the ranks wait on each other forever. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` on the
launcher avoids it (pytorch/pytorch#135712); d9d also puts every attempt's keys under their
own prefix, so the documented launch needs no variable. Store and collectives time out
(``TIMEOUT``) instead of waiting forever.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["TIMEOUT", "init_process_group"]

# How long a collective or a store wait may take before the rank fails (torchrun then restarts
# the job); the longest step or restore of the presets on a shared CPU box is well under it.
TIMEOUT = timedelta(minutes=10)


def _attempt_store() -> dist.Store | None:
    """The agent's shared store with this attempt's prefix, or ``None`` when not shared."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=TIMEOUT,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"d9d/attempt_{attempt}", store)


def init_process_group() -> None:
    """Join the job torchrun started: NCCL on CUDA, else gloo; one prefix per attempt."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    store = _attempt_store()
    if store is None:
        dist.init_process_group(backend, timeout=TIMEOUT)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=TIMEOUT)
