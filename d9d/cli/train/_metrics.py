"""The speed and memory figures of a logged step of ``d9d train``: tokens per second, seconds
per step, peak memory and, on a device of known peak, model FLOPs utilization."""

from __future__ import annotations

import resource
import sys

import torch

from .._flops import mfu, peak_bf16_flops, peak_fp8_flops
from ._resume import say

__all__ = ["SpeedMeter", "peak_memory"]


def peak_memory(device: torch.device) -> dict[str, float]:
    """``peak_memory_gib``: the most GPU memory torch allocated on ``device``; on CPU,
    ``peak_rss_gib``: this process's peak resident set size (all its memory, not only
    tensors)."""
    if device.type == "cuda":
        return {"peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024  # Linux counts KiB
    return {"peak_rss_gib": peak_bytes / 2**30}


class SpeedMeter:
    """Tokens per second, seconds per step and MFU since the last logged step.

    Args:
        tokens_per_step: Tokens of one global batch.
        flops_per_token: Training FLOPs per token (``train_flops_per_token``).
        device: The device this rank trains on; MFU only on a GPU of ``PEAK_BF16_FLOPS``.
        devices: Devices the run trains on (the world size).
        fp8: The run's linears compute in fp8 (``--fp8``): ``mfu`` is against the fp8 peak
            (``PEAK_FP8_FLOPS``) and ``mfu_bf16`` against the bf16 one beside it.
    """

    def __init__(
        self,
        tokens_per_step: int,
        flops_per_token: int,
        device: torch.device,
        devices: int,
        fp8: bool = False,
    ) -> None:
        self._tokens_per_step = tokens_per_step
        self._flops_per_token = flops_per_token
        self._devices = devices
        self._peaks: dict[str, float] = {}
        if device.type != "cuda":
            return
        name = torch.cuda.get_device_name(device)
        bf16, fp8_peak = peak_bf16_flops(name), peak_fp8_flops(name)
        if fp8 and fp8_peak is not None:
            self._peaks["mfu"] = fp8_peak
        elif fp8:
            say(f"no fp8 MFU in the metrics: the fp8 peak FLOP/s of {name!r} is not known to d9d")
        if bf16 is not None:
            self._peaks["mfu_bf16" if fp8 else "mfu"] = bf16
        else:
            say(f"no MFU in the metrics: the peak FLOP/s of {name!r} is not known to d9d")

    def measure(self, steps: int, seconds: float) -> dict[str, float]:
        """``tokens_per_s``, ``step_time_s`` (and ``mfu``, ``mfu_bf16``) of ``steps`` steps
        in ``seconds``."""
        tokens_per_s = self._tokens_per_step * steps / seconds
        figures = {"tokens_per_s": tokens_per_s, "step_time_s": seconds / steps}
        for key, peak in self._peaks.items():
            figures[key] = mfu(self._flops_per_token, tokens_per_s, peak, self._devices)
        return figures
