"""What the multi-rank benchmarks share: their batches, each rank's device, timed steps.

The scripts run as ``python benchmarks/<name>.py``, so this directory is on ``sys.path``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def token_batches(vocab: int, global_batch: int, seq_len: int, count: int) -> list[dict]:
    """``count`` random ``{"tokens", "labels"}`` batches (labels shifted by one), seeded."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


def rank_device() -> torch.device:
    """This rank's CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def time_steps(
    run: Callable[[Any], Any], batches: list[Any], device: torch.device, warmup: int
) -> list[float]:
    """Seconds of ``run(batch)`` per batch after the first ``warmup`` (CUDA synchronized)."""
    times = []
    for i, batch in enumerate(batches):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times
