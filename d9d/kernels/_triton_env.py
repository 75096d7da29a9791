"""Where the Triton backends can run: CUDA, or CPU under ``TRITON_INTERPRET=1`` (tests only).

Checked without importing Triton, so listing backends stays cheap and works without it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = ["TRITON_DTYPES", "triton_auto", "triton_unavailable"]

TRITON_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


@functools.cache
def _installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "yes", "on"}


def triton_unavailable(device_type: str | None) -> str | None:
    """Why the Triton backends cannot run on ``device_type`` here (any device if None)."""
    if not _installed():
        return "triton is not installed (pip install 'd9d[triton]')"
    match device_type:
        case None if torch.cuda.is_available() or _interpret():
            return None
        case None:
            return "no CUDA device and TRITON_INTERPRET is not set"
        case "cuda":
            return None
        case "cpu" if _interpret():
            return None
        case "cpu":
            return (
                "tensors are on cpu and TRITON_INTERPRET is not set "
                "(Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1)"
            )
        case _:
            return (
                f"Triton runs on cuda tensors (or cpu under TRITON_INTERPRET=1), not {device_type}"
            )


def triton_auto(device_type: str) -> bool:
    """Automatic selection picks Triton on CUDA only: the CPU interpreter is a test tool."""
    return device_type == "cuda"
