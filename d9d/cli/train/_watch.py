"""Where ``d9d train`` shows a run while it goes, besides ``metrics.jsonl``: TensorBoard
event files (by default, when the ``tensorboard`` package is installed) and Weights & Biases
(``--wandb``; the ``WANDB_*`` variables apply: ``WANDB_MODE=offline`` keeps the run on disk,
in ``WANDB_DIR``, default the run's folder). Only rank 0 writes. Both packages are imported
here, when a run starts, never by ``import d9d`` or ``d9d --help``."""

from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from .._config import TrainConfig
from ._resume import say

__all__ = ["Dashboards"]


class Dashboards:
    """The TensorBoard writer and W&B run of rank 0 (none on other ranks).

    Args:
        config: The run's options (``out``, ``tensorboard``, ``wandb``, ``wandb_project``).
        config_json: The run's options as ``config.json`` holds them (W&B's run config).
        first_step: Steps done before this call: the TensorBoard events of an earlier run in
            ``out`` are replaced from step ``first_step + 1`` on. None: learned later
            (:meth:`start_at`; a torchft replica group learns it at its first quorum).
        rank0: Whether this process writes.
    """

    def __init__(
        self,
        config: TrainConfig,
        config_json: dict[str, Any],
        first_step: int | None,
        rank0: bool,
    ) -> None:
        self._tensorboard = None
        self._wandb = None
        self._directory = config.out / "tensorboard" if rank0 and config.tensorboard else None
        if not rank0:
            return
        if first_step is not None:
            self.start_at(first_step)
        if config.wandb:
            import wandb

            self._wandb = wandb.init(
                project=config.wandb_project,
                dir=os.environ.get("WANDB_DIR", str(config.out)),
                config=config_json,
                name=config.out.name,
            )

    def start_at(self, first_step: int) -> None:
        """Open the TensorBoard writer of a run that starts after ``first_step`` steps."""
        if self._directory is not None and self._tensorboard is None:
            self._tensorboard = _tensorboard_writer(self._directory, first_step)

    def write(self, record: dict[str, float]) -> None:
        """Every value of ``record`` but ``step``, as a scalar at ``record["step"]``."""
        step = int(record["step"])
        scalars = {k: v for k, v in record.items() if k != "step"}
        if self._tensorboard is not None:
            for name, value in scalars.items():
                self._tensorboard.add_scalar(name, value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def __enter__(self) -> Dashboards:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=0 if error is None else 1)


def _tensorboard_writer(directory: Path, first_step: int) -> Any:
    """A ``SummaryWriter`` into ``directory``, or None (said once) without ``tensorboard``."""
    if importlib.util.find_spec("tensorboard") is None:
        say(
            "TensorBoard is not installed, so no event files are written: "
            "pip install 'd9d[tensorboard]', or pass --no-tensorboard to silence this"
        )
        return None
    from torch.utils.tensorboard import SummaryWriter

    earlier = any(directory.glob("*tfevents*"))
    if earlier:
        _wait_to_sort_last(directory)
    # purge_step: TensorBoard drops an earlier run's events from the step this one starts at
    # (a resumed run's, or a replica group's that continues in its --out after a restart).
    return SummaryWriter(str(directory), purge_step=first_step + 1 if earlier else None)


_EVENT_FILE_SECOND = re.compile(r"tfevents\.(\d+)\.")
_LONGEST_WAIT_S = 5


def _wait_to_sort_last(directory: Path) -> None:
    """Waits until the clock is past the second in every event file's name in ``directory``.

    TensorBoard reads a run's event files in name order, and a ``purge_step`` hides only
    the earlier events it has read before: the resumed run's file must sort last. Its name
    starts with the second it was opened in; within one second, host, pid and a counter
    (compared as text: 10 before 9) decide, so a run resumed within the second of the last
    file could show each step twice. A newest file stamped more than a few seconds ahead
    (a clock set back) is said, not waited for.
    """
    seconds = [int(m.group(1)) for f in directory.glob("*tfevents*")
               if (m := _EVENT_FILE_SECOND.search(f.name))]  # fmt: skip
    if not seconds:
        return
    newest = max(seconds)
    if newest - time.time() > _LONGEST_WAIT_S:
        say(
            f"TensorBoard: an event file in {directory} is stamped {newest - time.time():.0f} s "
            "in the future (a clock set back?); the resumed steps may show twice there"
        )
        return
    while int(time.time()) <= newest:
        time.sleep(0.05)
