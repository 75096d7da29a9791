"""``d9d train``'s checkpoints: saved every few steps, committed only once the next step proves
their params sane, and the finiteness check that decides it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ... import checkpoint, data

__all__ = ["Checkpointer", "check_finite"]


class Checkpointer:
    """Train-state checkpoints every ``save_every`` steps, one asynchronous save at a time.

    A checkpoint is held (written, not committed) until the next step's loss and gradient
    norm, computed from its params, are found finite: an update after a finite loss can
    still ruin the params (at ``--lr 1e6`` step 2's params are finite, their gradient NaN).
    """

    def __init__(self, directory: Path, every: int, keep: int | None) -> None:
        self.directory, self.every, self.keep = directory, every, keep
        self._pending: checkpoint.SaveHandle | None = None
        self.held: int | None = None  # the step of a save awaiting vouch() or discard()

    def due(self, step: int) -> bool:
        """Whether ``step`` is saved."""
        return bool(self.every) and step % self.every == 0

    def save(
        self,
        step: int,
        params: Any,
        opt_state: Any,
        loader: data.TokenLoader,
        metadata: Any = None,
    ) -> None:
        """Save ``step``'s train state (and JSON ``metadata``: a replica group's torchft
        manager state), held until :meth:`vouch`."""
        self.wait()
        self._pending = checkpoint.save_train_state(
            self.directory,
            step=step,
            params=params,
            opt_state=opt_state,
            data=loader.state_dict(),
            metadata=metadata,
            keep=self.keep,
            hold=True,
        )
        self.held = step

    def vouch(self) -> None:
        """The held checkpoint's params gave a finite step: let it commit."""
        if self.held is not None:
            self._pending.commit()
            self.held = None

    def commit_now(self) -> Path:
        """Commit the held checkpoint and return once it is committed, with its path: a
        preempted run has no next step to vouch for it (its own step was finite)."""
        self.vouch()
        pending, self._pending = self._pending, None
        return pending.wait()

    def discard(self) -> None:
        """The held checkpoint's params gave a non-finite step: drop it."""
        if self.held is not None:
            self._pending.discard()
            self.held = None
        self.wait()

    def wait(self) -> None:
        """Wait for the save in flight; a held one commits (its own step was finite)."""
        self.vouch()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()


def check_finite(step: int, metrics: dict[str, Any], saver: Checkpointer) -> tuple[float, float]:
    """The step's loss and gradient norm; raises before a non-finite one is logged or saved."""
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return loss, grad_norm
    directory, held = str(saver.directory), saver.held
    if held is not None:
        kept = (
            f"; step {held}'s checkpoint, whose params gave them, is dropped and the older "
            f"ones in {directory!r} stay"
        )
    else:
        kept = f"; the checkpoints in {directory!r} stay" if saver.every else ""
    raise FloatingPointError(
        f"loss is {loss} and gradient norm {grad_norm} at step {step}{kept}. "
        "Lower --lr or check the data"
    )
