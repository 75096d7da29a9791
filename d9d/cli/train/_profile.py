"""``d9d train --profile``: a ``torch.profiler`` trace of a few steps, after one warmup step
(the first step of a run allocates, and under ``--jit`` compiles), as Chrome trace JSON
(open it in https://ui.perfetto.dev or chrome://tracing)."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["StepProfiler"]


class StepProfiler:
    """Profiles steps ``first + 1 .. first + steps`` of this call (0-based step indices); ``path``
    gets the trace once they ran, or when the run ends before (``steps=0``: off).

    Args:
        path: The trace file to write.
        first: The first step index this call runs (the warmup step; not profiled).
        steps: Steps to profile.
    """

    def __init__(self, path: Path, first: int, steps: int) -> None:
        self._path = path
        self._start, self._stop = first + 1, first + 1 + steps
        self._profile: profile | None = None

    def before(self, index: int) -> None:
        """Call before step ``index`` runs."""
        if index == self._start and self._start < self._stop:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._profile = profile(activities=activities, record_shapes=True)
            self._profile.__enter__()

    def after(self, index: int) -> None:
        """Call after step ``index`` ran."""
        if index + 1 == self._stop:
            self._finish()

    def _finish(self) -> None:
        if self._profile is None:
            return
        self._profile.__exit__(None, None, None)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(self._path))
        self._profile = None

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._finish()
