"""``peak_rss_growth``: how far a call raises this process's resident memory at its peak.

``tracemalloc`` does not see torch's allocations and ``ru_maxrss`` never goes down, so the
high-water mark is reset through ``/proc/self/clear_refs`` (Linux) before the call and read
from ``VmHWM`` after it. File pages an mmap faults in count, as they do for the OOM killer.

Before the baseline, the C heap's free memory goes back to the system (glibc's
``malloc_trim``): a process forked from a long-lived one (a test rank from a pytest worker)
inherits that worker's freed but resident heap, and allocations reusing it raise no page, so
a call holding 150 MiB could measure 3 MiB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["peak_rss_growth"]

T = TypeVar("T")
_STATUS = Path("/proc/self/status")


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{_STATUS} has no {field} line")


def _release_free_heap() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "malloc_trim"):
        raise OSError("peak_rss_growth needs glibc's malloc_trim to measure from a clean heap")
    libc.malloc_trim(0)


def peak_rss_growth(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, int]:
    """Run ``fn(*args, **kwargs)`` and return its result and the peak resident-memory growth.

    The growth is the process's resident set at its highest during the call minus the
    resident set just before it, in bytes. Run it in a process of its own (a forked or
    spawned rank) so no other thread allocates meanwhile.

    Raises:
        OSError: Not on Linux (no ``/proc/self/clear_refs``) or not on glibc (no
            ``malloc_trim``).

    Example:
        >>> import torch
        >>> _, grown = peak_rss_growth(lambda: torch.ones(2**25).sum())  # 128 MiB
        >>> grown > 100 * 2**20
        True
    """
    _release_free_heap()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_bytes("VmRSS")
    result = fn(*args, **kwargs)
    return result, _status_bytes("VmHWM") - before
