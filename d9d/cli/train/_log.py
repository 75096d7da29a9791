"""``metrics.jsonl`` of ``d9d train``: one JSON record per logged step, kept through kills.

Every record is flushed to the OS as it is written, so a ``kill -9`` loses none; before a
checkpoint is saved the file is also fsynced, so every record up to a committed checkpoint
survives a machine crash too. A resumed run keeps the records up to the step it restored,
drops the later ones (the resumed run writes them again) and a last line torn by a kill, and
rewrites the file atomically (a temporary file renamed over it), so a kill during the rewrite
leaves either the old file or the new one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["MetricsLog"]


def _kept(path: Path, last_step: int) -> list[str]:
    """The complete records of ``path`` with ``step <= last_step``."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line torn by a kill: only ever the last one
            continue
        if isinstance(record, dict) and record.get("step", last_step + 1) <= last_step:
            kept.append(line)
    return kept


class MetricsLog:
    """The metrics file of a run starting after ``first_step`` (``path`` None: write
    nothing; ``first_step`` None: not known yet, :meth:`keep_through` tells it)."""

    def __init__(self, path: Path | None, first_step: int | None) -> None:
        self._file = None
        self._path = path
        if path is not None and first_step is not None:
            self.keep_through(first_step)

    def keep_through(self, first_step: int) -> None:
        """Keep the records up to ``first_step`` (a torchft replica group learns where it
        starts at its first quorum: 0, or the live groups' step when it rejoins them)."""
        path = self._path
        if path is None:
            return
        if self._file is not None:
            self._file.close()
        if path.exists():
            kept = _kept(path, first_step) if first_step > 0 else []
            tmp = path.with_name(f"{path.name}.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
        self._file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record and hand it to the OS (it survives a kill of this process)."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def sync(self) -> None:
        """Put every record written so far on disk (before a checkpoint of that step)."""
        if self._file is not None:
            os.fsync(self._file.fileno())

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._file is not None:
            self._file.close()
