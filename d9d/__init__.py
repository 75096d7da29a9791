"""d9d: JAX-style functional transforms for distributed training on PyTorch."""

from . import checkpoint as checkpoint
from . import data as data
from . import errors as errors
from . import kernels as kernels
from . import losses as losses
from . import models as models
from . import optim as optim
from . import parallel as parallel
from . import testing as testing
from . import transforms as transforms
from . import tree as tree
from ._autodiff import grad as grad
from ._autodiff import value_and_grad as value_and_grad
from ._comms import CommStats as CommStats
from ._jit import Jitted as Jitted
from ._jit import jit as jit
from ._mesh import AXIS_ORDER as AXIS_ORDER
from ._mesh import make_mesh as make_mesh
from ._module import Axes as Axes
from ._module import Model as Model
from ._module import functionalize as functionalize
from ._plan import ParamPlan as ParamPlan
from ._plan import Plan as Plan
from ._process_group import init_process_group as init_process_group
from ._step import Memory as Memory
from ._step import Transform as Transform
from ._step import TransformedStep as TransformedStep
from .transforms import context_parallel as context_parallel
from .transforms import pipeline as pipeline
from .transforms import shard_params as shard_params
from .transforms import tensor_parallel as tensor_parallel

__version__ = "0.1.0"

__all__ = [
    "AXIS_ORDER",
    "Axes",
    "CommStats",
    "Jitted",
    "Memory",
    "Model",
    "ParamPlan",
    "Plan",
    "Transform",
    "TransformedStep",
    "checkpoint",
    "context_parallel",
    "data",
    "errors",
    "functionalize",
    "grad",
    "init_process_group",
    "jit",
    "kernels",
    "losses",
    "make_mesh",
    "models",
    "optim",
    "parallel",
    "pipeline",
    "shard_params",
    "tensor_parallel",
    "testing",
    "transforms",
    "tree",
    "value_and_grad",
]
