"""d9d: JAX-style functional transforms for distributed training on PyTorch."""

from . import data as data
from . import errors as errors
from . import losses as losses
from . import models as models
from . import optim as optim
from . import testing as testing
from . import tree as tree
from ._autodiff import grad as grad
from ._autodiff import value_and_grad as value_and_grad
from ._jit import Jitted as Jitted
from ._jit import jit as jit
from ._module import Axes as Axes
from ._module import Model as Model
from ._module import functionalize as functionalize

__version__ = "0.1.0"

__all__ = [
    "Axes",
    "Jitted",
    "Model",
    "data",
    "errors",
    "functionalize",
    "grad",
    "jit",
    "losses",
    "models",
    "optim",
    "testing",
    "tree",
    "value_and_grad",
]
