"""What a pipeline is on this rank: the schedules it can run (``SCHEDULES``), which rank owns
a stage, this rank's layout (its stages, groups and schedule) and the stage forward in
progress (``StageRun``, ended early by ``StageDone``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ._stages import StageSplit

__all__ = ["SCHEDULES", "PipelineLayout", "ScheduleKind", "StageDone", "StageRun", "stage_owner"]


@dataclass(frozen=True)
class ScheduleKind:
    """A ``torch.distributed.pipelining`` schedule: its class, stage placement, the stages
    per rank it runs (None: any), whether it runs several, whether it takes input and
    weight grads in separate backward passes (zero bubble), and whether every microbatch
    of a stage runs the same actions, so that a dry run may count it from its first
    (``uniform``; DualPipeV takes some backwards whole, input and weight grads in one
    pass, and splits others: its first stage-15 backward of DeepSeek-V3 under pp=8 is a
    whole one, and sampled it counted 1,086 all-to-alls for the schedule's 861)."""

    name: str
    style: str
    virtual_stages: int | None
    multi: bool
    zero_bubble: bool = False
    uniform: bool = True


SCHEDULES = {
    "gpipe": ScheduleKind("ScheduleGPipe", "loop", 1, False),
    "1f1b": ScheduleKind("Schedule1F1B", "loop", 1, False),
    "interleaved_1f1b": ScheduleKind("ScheduleInterleaved1F1B", "loop", None, True),
    "interleaved_zb": ScheduleKind("ScheduleInterleavedZeroBubble", "loop", None, True, True),
    "zbv": ScheduleKind("ScheduleZBVZeroBubble", "v", 2, True, True),
    "dualpipev": ScheduleKind("ScheduleDualPipeV", "v", 2, True, True, uniform=False),
}


def stage_owner(stage: int, size: int, style: str) -> int:
    """The pipeline rank running ``stage``: round robin (``loop``) or down and back (``v``)."""
    if style == "v":
        return stage if stage < size else 2 * size - 1 - stage
    return stage % size


@dataclass(eq=False)
class PipelineLayout:
    """This rank's part of a pipeline: the split, its stages, the groups and the schedule;
    ``run`` is the stage forward in progress, if any."""

    axis: str
    index: int
    group: Any
    rank: int
    size: int
    split: StageSplit
    schedule: str
    microbatches: int
    local_stages: tuple[int, ...]
    stage_mesh: DeviceMesh
    tie_group: Any
    cache: dict[Any, Any] = field(default_factory=dict, repr=False)
    run: StageRun | None = field(default=None, repr=False)

    @property
    def held(self) -> tuple[str, ...]:
        """Paths of the params this rank holds, stage by stage."""
        return tuple(dict.fromkeys(k for s in self.local_stages for k in self.split.keys[s]))

    def owner(self, stage: int) -> int:
        """The pipeline rank of ``stage``."""
        return stage_owner(stage, self.size, SCHEDULES[self.schedule].style)

    def ranks_holding(self, key: str) -> int:
        """How many pipeline ranks hold param ``key`` (2 for a tied param on two ranks)."""
        return len({self.owner(s) for s in self.split.stages_of(key)})


@dataclass
class StageRun:
    """One stage's forward of one microbatch, in progress on this thread.

    ``input`` holds the tensors the previous stage sent (None on the first stage) and
    ``output`` those this stage sends: the activation, or every leaf of a carried state
    (a block taking and returning a tuple, ``_stage_apply.py``)."""

    stage: int
    start: int
    stop: int
    first: bool
    last: bool
    input: tuple[torch.Tensor, ...] | None
    output: torch.Tensor | tuple[torch.Tensor, ...] | None = None
    entered: bool = False
    applied: bool = False
    carried: bool = False  # the block running takes a carried state (a tuple) first
    visited: int = -1  # the last block the forward reached (run or skipped)
    done: bool = False  # the forward is over (a block recomputed later is not checked)


class StageDone(Exception):
    """Raised after the last block of a stage that is not the last one."""
