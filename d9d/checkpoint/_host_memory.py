"""Large host buffers on transparent huge pages, for the copies a save or restore makes.

A fresh ``torch.empty`` faults its pages in 4 KiB at a time during the first write: copying
155 MiB into one took 0.14-0.21 s on the 2-core CPU box, into a buffer advised
``MADV_HUGEPAGE`` 0.044-0.057 s, and into a reused buffer 0.028 s (``docs/checkpoint.md``,
"Performance"). Used for async-save snapshots only: a restore's outputs stay plain, since
where the kernel must first compact memory to find huge pages the first restore after a
save took 0.21 s instead of 0.044 s.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import sys
from collections.abc import Sequence

import torch

__all__ = ["host_empty"]

# Below this, a mapping of its own per tensor would cost more than the faults it saves.
_MIN_MAPPED_BYTES = 4 << 20


def host_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; from ``_MIN_MAPPED_BYTES`` on, an anonymous mapping of
    its own advised onto huge pages (Linux), freed with the tensor."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < _MIN_MAPPED_BYTES:
        return torch.empty(tuple(shape), dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if sys.platform == "linux":
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: EINVAL
            mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(tuple(shape))
