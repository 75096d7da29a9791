"""Transforms of a training step onto a device mesh, and what they produce (``d9d.transforms``).

Each transform is a package holding its rule (how it rewrites a param's plan) and its runtime
(what it does while the step runs): ``shard_params``, ``tensor_parallel``,
``context_parallel``, ``expert_parallel``, ``fault_tolerant``, ``diloco`` (a step wrapper), ``fp8``, ``pipeline``, ``remat``. Here too are the protocol they implement
(:class:`Transform`, its :class:`Phase`, :class:`Runtime`) and the types a transformed step hands back: its
:class:`Plan` of :class:`ParamPlan` entries, :class:`Memory`, :class:`CommStats`, and the
:class:`Jitted` step of ``d9d.jit``.
"""

from typing import TYPE_CHECKING, Any

from ..core._comm_count import CommStats as CommStats
from ..core._memory import Memory as Memory
from ..core._param_plan import Cast as Cast
from ..core._param_plan import ParamPlan as ParamPlan
from ..core._phase import Phase as Phase
from ..core._plan import Plan as Plan
from ..core._runtime import ApplyCall as ApplyCall
from ..core._runtime import Differentiation as Differentiation
from ..core._runtime import Interception as Interception
from ..core._runtime import Runtime as Runtime
from ..core._step import TransformedStep as TransformedStep
from ..core._transform import Transform as Transform
from .context_parallel import ContextParallel as ContextParallel
from .context_parallel import context_parallel as context_parallel
from .diloco import DiLoCo as DiLoCo
from .diloco import DiLoCoState as DiLoCoState
from .diloco import DiLoCoStep as DiLoCoStep
from .diloco import diloco as diloco
from .expert_parallel import ExpertParallel as ExpertParallel
from .expert_parallel import expert_parallel as expert_parallel
from .fault_tolerant import FaultTolerant as FaultTolerant
from .fault_tolerant import fault_tolerant as fault_tolerant
from .fp8 import Fp8 as Fp8
from .fp8 import fp8 as fp8
from .pipeline import Pipeline as Pipeline
from .pipeline import pipeline as pipeline
from .remat import Remat as Remat
from .remat import remat as remat
from .shard_params import ShardParams as ShardParams
from .shard_params import shard_params as shard_params
from .tensor_parallel import DEFAULT_RULES as DEFAULT_RULES
from .tensor_parallel import TensorParallel as TensorParallel
from .tensor_parallel import tensor_parallel as tensor_parallel

if TYPE_CHECKING:
    from ..core._jit import Jitted as Jitted


def __getattr__(name: str) -> Any:
    # ``Jitted`` comes with ``d9d.core._jit``, which imports torch's compiler (about 2 s): loaded
    # when asked for, so that ``d9d plan`` and the transforms start without it.
    if name == "Jitted":
        from ..core._jit import Jitted

        return Jitted
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_RULES",
    "ApplyCall",
    "Cast",
    "CommStats",
    "ContextParallel",
    "DiLoCo",
    "DiLoCoState",
    "DiLoCoStep",
    "Differentiation",
    "ExpertParallel",
    "FaultTolerant",
    "Fp8",
    "Interception",
    "Jitted",
    "Memory",
    "ParamPlan",
    "Phase",
    "Pipeline",
    "Plan",
    "Remat",
    "Runtime",
    "ShardParams",
    "TensorParallel",
    "Transform",
    "TransformedStep",
    "context_parallel",
    "diloco",
    "expert_parallel",
    "fault_tolerant",
    "fp8",
    "pipeline",
    "remat",
    "shard_params",
    "tensor_parallel",
]
