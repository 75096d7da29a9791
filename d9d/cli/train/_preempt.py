"""SIGTERM in ``d9d train``: Slurm and Kubernetes preempt a job with SIGTERM, then SIGKILL.

On the first SIGTERM the run finishes the step in flight, saves it and commits the checkpoint
before going on, says so in one line and exits with :data:`PREEMPTED_EXIT_CODE`; a second
SIGTERM ends the process at once (the handler gives SIGTERM back to the kernel's default).
Ranks may get the signal at different moments, or only some of them: at every step boundary
they agree through one all-reduce of a flag on a CPU tensor (on the default group, or on a
gloo group made once when that is NCCL's), so every rank stops after the same step. The
all-reduce needs no device sync; docs/train.md says what it costs.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

from ._resume import say

__all__ = ["PREEMPTED_EXIT_CODE", "Preemption"]

# Default-group backends that cannot all-reduce a CPU tensor (gloo, threaded, mpi can).
_DEVICE_ONLY = ("nccl", "xccl")

PREEMPTED_EXIT_CODE = 143
"""What ``d9d train`` exits with after a SIGTERM: 128 + 15, what a shell reports for a process
that SIGTERM ended, so a requeue script sees 143 whichever way SIGTERM ended the run."""


class Preemption:
    """The SIGTERM handler of one training loop, and the ranks' agreement to stop.

    Use it as a context manager around the loop (it must be entered on every rank, in the
    same order as the other collectives) and ask :meth:`agreed` after every step.
    """

    def __init__(self) -> None:
        self.requested = False  # this process got SIGTERM
        self.stopped_at: int | None = None  # the step the run stopped after, once it did
        self._installed = False
        self._previous: Any = None  # the SIGTERM handler before this one (None: set from C)
        self._group: dist.ProcessGroup | None = None

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # handlers live only there
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        if dist.is_initialized() and dist.get_backend() in _DEVICE_ONLY:
            self._group = dist.new_group(backend="gloo")  # a flag on CPU: no device sync
        return self

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once

    def agreed(self) -> bool:
        """Whether every rank stops after this step: whether any rank got SIGTERM (collective)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.requested
        flag = torch.tensor([int(self.requested)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def stop(self, step: int, steps: int, path: Path) -> None:
        """Record that the run stopped after ``step`` with ``path`` committed, and say so."""
        self.stopped_at = step
        say(
            f"SIGTERM: stopped after step {step} of {steps} and committed {str(path)!r}; "
            f"exiting with code {PREEMPTED_EXIT_CODE} (continue with --resume)"
        )

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
