"""d9d: JAX-style functional transforms for distributed training on PyTorch.

Names load on first use, so ``import d9d`` (and the ``d9d`` command's ``--help``) stays fast:
``d9d.jit`` imports ``torch`` and the core, ``d9d.testing`` only when asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_NAMES = {
    "AXIS_ORDER": "._mesh",
    "Axes": "._structure",
    "Model": "._model",
    "context_parallel": ".transforms",
    "functionalize": "._model",
    "grad": "._autodiff",
    "init_process_group": "._process_group",
    "jit": "._jit",
    "make_mesh": "._mesh",
    "pipeline": ".transforms",
    "remat": ".transforms",
    "shard_params": ".transforms",
    "tensor_parallel": ".transforms",
    "value_and_grad": "._autodiff",
}
_PACKAGES = (
    "checkpoint",
    "data",
    "errors",
    "hf",
    "kernels",
    "losses",
    "models",
    "optim",
    "parallel",
    "testing",
    "transforms",
    "tree",
)

__all__ = [
    "AXIS_ORDER",
    "Axes",
    "Model",
    "checkpoint",
    "context_parallel",
    "data",
    "errors",
    "functionalize",
    "grad",
    "hf",
    "init_process_group",
    "jit",
    "kernels",
    "losses",
    "make_mesh",
    "models",
    "optim",
    "parallel",
    "pipeline",
    "remat",
    "shard_params",
    "tensor_parallel",
    "testing",
    "transforms",
    "tree",
    "value_and_grad",
]


def __getattr__(name: str) -> Any:
    if name in _PACKAGES:
        return importlib.import_module(f".{name}", __name__)
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'd9d' has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*globals(), *__all__]


if TYPE_CHECKING:
    from . import (
        checkpoint,
        data,
        errors,
        hf,
        kernels,
        losses,
        models,
        optim,
        parallel,
        testing,
        transforms,
        tree,
    )
    from ._autodiff import grad, value_and_grad
    from ._jit import jit
    from ._mesh import AXIS_ORDER, make_mesh
    from ._model import Model, functionalize
    from ._process_group import init_process_group
    from ._structure import Axes
    from .transforms import context_parallel, pipeline, remat, shard_params, tensor_parallel
