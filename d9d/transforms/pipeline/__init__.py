"""``pipeline``: the model's blocks cut into stages over a mesh axis and run by a
``torch.distributed.pipelining`` schedule; the split, the stage apply, the executor, the
probe of activation shapes and the trace of stage spans."""

from ._layout import SCHEDULES as SCHEDULES
from ._layout import PipelineLayout as PipelineLayout
from ._runtime import PipelineRuntime as PipelineRuntime
from ._stage_trace import stage_spans as stage_spans
from ._stages import StageSplit as StageSplit
from ._stages import split_stages as split_stages
from ._transform import Pipeline as Pipeline
from ._transform import pipeline as pipeline

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "PipelineLayout",
    "PipelineRuntime",
    "StageSplit",
    "pipeline",
    "split_stages",
    "stage_spans",
]
