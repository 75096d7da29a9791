"""The runtime of ``pipeline``: it drives ``d9d.value_and_grad`` (the microbatch executor)
and cuts each ``Model.apply`` down to the running stage."""

from __future__ import annotations

from typing import Any

import torch

from ...core._plan import Plan
from ...core._runtime import ApplyCall, Differentiation, Runtime
from ._executor import run_pipeline
from ._layout import SCHEDULES, PipelineLayout
from ._stage_apply import enter_stage

__all__ = ["PipelineRuntime"]


class PipelineRuntime(Runtime):
    """Runs the step's loss stage by stage under a ``torch.distributed.pipelining`` schedule."""

    drives_differentiation = True
    accumulates_grads = True  # the stage's weights' .grad, reduced once (run_pipeline)

    def __init__(self, layout: PipelineLayout, plan: Plan) -> None:
        self.layout = layout
        self.plan = plan

    def differentiate(
        self, job: Differentiation
    ) -> tuple[torch.Tensor, Any, list[Any], torch.Tensor | None]:
        return run_pipeline(job, self.plan, self.layout)

    def enter_apply(self, call: ApplyCall) -> None:
        enter_stage(self.layout, call)

    def traits(self) -> dict[str, str]:
        if SCHEDULES[self.layout.schedule].zero_bubble:
            how = "takes each stage's input grads and its weight grads in two backward passes"
            return {"split backward": how}
        return {}

    def jit_refusal(self) -> str:
        return (
            "d9d.jit does not compile a pipeline step: its schedule runs stages and "
            "point-to-point transfers eagerly; drop d9d.jit (compile the model's blocks with "
            "torch.compile instead)"
        )

    def group_labels(self) -> dict[str, str]:
        tie = self.layout.tie_group
        return {tie.group_name: self.layout.axis} if tie is not None else {}
