"""The background half of ``save``: write this rank's shards, meet the others, commit.

Ranks meet when their writes end through the process group's key-value store rather than
a collective: the store is thread-safe and needs no device, whereas a collective issued
from a second thread would interleave with the training loop's collectives on the same
group (torch DCP's ``async_save`` needs a second gloo group for this; the store needs
nothing). Each rank posts its outcome under a key named by a nonce from rank 0; rank 0
commits once every rank has written, then posts the result that the other ranks'
``wait()`` returns. A failure anywhere means no commit, on every rank.
"""

from __future__ import annotations

import shutil
import threading
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import tensorstore as ts
import torch

from ..errors import CheckpointExistsError, CheckpointSaveError
from . import _claim, _format
from ._claim import Claim
from ._layout import box_slices, brief, to_numpy

__all__ = ["SaveHandle", "Write", "WriteJob", "post_failure"]

# How long a rank waits for the others to finish writing (or rank 0 to commit).
_COMMIT_TIMEOUT = timedelta(minutes=30)
# How often a held save checks that the program has not ended without commit() or discard().
_HELD_POLL_S = 0.5


def post_failure(store: Any, key: str, rank: int, why: str) -> None:
    """Post that this rank's part of save ``key`` failed: rank 0 the result every rank waits
    for (``key/done``), another rank its outcome, which rank 0 waits for (``key/rank<r>``)."""
    if rank == 0:
        store.set(f"{key}/done", f"rank 0 did not commit: {why}")
    else:
        store.set(f"{key}/rank{rank}", why)


@dataclass(frozen=True)
class Write:
    spec: dict[str, Any]
    offset: tuple[int, ...]
    data: torch.Tensor  # this rank's host copy of the box


@dataclass
class WriteJob:
    """Everything the background thread needs; it touches no caller-owned tensor."""

    tmp: Path
    final: Path
    meta: dict[str, Any]
    keep: int | None
    creates: list[dict[str, Any]]
    writes: list[Write]
    rank: int
    world: int
    store: Any  # a torch.distributed Store, None on one process
    key: str
    gate: threading.Event | None = None  # a held save commits once it is set
    claim: Claim | None = None  # rank 0's lock on ``tmp``, released once committed or removed
    discarded: bool = False  # set with the gate: drop the written data instead
    error: BaseException | None = field(default=None)

    def run(self) -> None:
        try:
            try:
                self._write()
            except BaseException as exc:
                self._finish(exc)
                raise
            self._finish(None)
        except BaseException as exc:
            self.error = exc

    def _write(self) -> None:
        context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
        pending = [ts.open(spec, create=True, context=context) for spec in self.creates]
        failures: list[Exception] = []
        try:
            for write in self.writes:
                array = ts.open(write.spec, assume_metadata=True, context=context).result()
                box = box_slices(write.offset, write.data.shape)
                pending.append(array[box].write(to_numpy(write.data)))
        except Exception as exc:
            failures.append(exc)
        for future in pending:  # all of them, so nothing is still writing after a failure
            try:
                future.result()
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    def _finish(self, error: BaseException | None) -> None:
        if self.rank != 0:
            if error is not None:
                post_failure(self.store, self.key, self.rank, brief(error))
                return
            self.store.set(f"{self.key}/rank{self.rank}", "ok")
            self.store.wait([f"{self.key}/done"], _COMMIT_TIMEOUT)
            done = self.store.get(f"{self.key}/done").decode()
            if done not in ("ok", "discarded"):
                # Rank 0 removed the folder, but it may have failed before this rank's
                # writes made it again (its host copy, in save).
                orphan = _claim.abandoned(self.tmp)
                if orphan is not None:
                    shutil.rmtree(self.tmp, ignore_errors=True)
                    orphan.release()
                raise CheckpointSaveError(done)
            return
        try:
            failures = [] if error is None else [f"rank 0: {brief(error)}"]
            if self.world > 1:
                keys = [f"{self.key}/rank{r}" for r in range(1, self.world)]
                self.store.wait(keys, _COMMIT_TIMEOUT)
                outcomes = [self.store.get(k).decode() for k in keys]
                failures += [f"rank {r}: {o}" for r, o in enumerate(outcomes, 1) if o != "ok"]
            if self.final.exists():  # another save of this step won: say so, whatever else
                failures = [f"{str(self.final)!r} is already committed by another save"]
            if failures:
                raise CheckpointSaveError(
                    f"Checkpoint of step {self.meta['step']} was not committed: "
                    + "; ".join(failures)
                )
            while self.gate is not None and not self.gate.wait(_HELD_POLL_S):
                if not threading.main_thread().is_alive():  # the program ended holding it
                    self.discarded = True  # (this thread kept it from exiting, for ever)
                    break
            if self.discarded:
                shutil.rmtree(self.tmp, ignore_errors=True)
                if self.world > 1:
                    self.store.set(f"{self.key}/done", "discarded")
                return
            try:
                _format.commit(self.tmp, self.final, self.meta)
            except CheckpointExistsError as exc:
                raise CheckpointSaveError(
                    f"Checkpoint of step {self.meta['step']} was not committed: {exc}"
                ) from None
            try:
                _format.rotate(self.final.parent, self.meta["step"], self.keep)
            except OSError as exc:  # committed all the same: what it failed to delete stays
                warnings.warn(
                    f"{str(self.final)!r} is committed, but cleaning up after it (keep="
                    f"{self.keep}) failed: {brief(exc)}; the checkpoints it meant to delete "
                    "stay, and the next save's rotation tries again",
                    stacklevel=1,
                )
        except BaseException as exc:
            shutil.rmtree(self.tmp, ignore_errors=True)  # no-op once committed (renamed)
            if self.world > 1:
                why = str(exc) if isinstance(exc, CheckpointSaveError) else brief(exc)
                post_failure(self.store, self.key, 0, why)
            raise
        finally:
            if self.claim is not None:
                self.claim.release()
        if self.world > 1:
            self.store.set(f"{self.key}/done", "ok")


class SaveHandle:
    """A checkpoint being saved; :meth:`wait` until it is committed.

    Attributes:
        path: The folder the checkpoint is committed to (``<directory>/step_<N>``).
    """

    def __init__(self, path: Path, job: WriteJob, thread: threading.Thread | None) -> None:
        self.path = path
        self._job = job
        self._thread = thread

    def done(self) -> bool:
        """Whether the save has ended (committed, or failed: then :meth:`wait` raises)."""
        return self._thread is None or not self._thread.is_alive()

    def commit(self) -> None:
        """Let a save made with ``hold=True`` commit once written (call it on every rank)."""
        self._decide(discard=False)

    def discard(self) -> None:
        """Drop a save made with ``hold=True``: nothing is committed, ``keep`` deletes
        nothing, and :meth:`wait` returns ``None`` (call it on every rank)."""
        self._decide(discard=True)

    def _decide(self, *, discard: bool) -> None:
        if self._job.gate is None:
            raise RuntimeError("only a save made with hold=True waits for commit() or discard()")
        self._job.discarded = self._job.discarded or discard
        self._job.gate.set()

    def wait(self) -> Path | None:
        """Block until the checkpoint is committed on every rank, and return its path.

        Returns:
            The checkpoint's path, or ``None`` when a held save was discarded.

        Raises:
            CheckpointSaveError: Some rank failed to write, or rank 0 failed to commit;
                nothing was committed and older checkpoints are untouched.
            RuntimeError: A save made with ``hold=True`` was neither committed nor discarded.
        """
        if self._job.gate is not None and not self._job.gate.is_set():
            raise RuntimeError(
                f"the save of step {self._job.meta['step']} is held: call commit() or discard() "
                "before wait()"
            )
        if self._thread is not None:
            self._thread.join()
        if self._job.error is not None:
            if isinstance(self._job.error, CheckpointSaveError):
                raise self._job.error
            raise CheckpointSaveError(
                f"Saving step {self._job.meta['step']} to {str(self.path)!r} failed on rank "
                f"{self._job.rank}: {brief(self._job.error)}"
            ) from self._job.error
        return None if self._job.discarded else self.path
