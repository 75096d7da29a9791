"""d9d: JAX-style functional transforms for distributed training on PyTorch.

Names load on first use, so ``import d9d`` (and the ``d9d`` command's ``--help``) stays fast:
``d9d.jit`` imports ``torch`` and the core, ``d9d.testing`` only when asked for.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Where each name is defined. The subpackages (``d9d.moe``, ``d9d.optim``, ...) and the
# transforms (one package each under ``transforms/``, exporting its own name) are read off the
# package's folders, so a new one resolves without an entry here.
_NAMES = {
    "AXIS_ORDER": ".core._mesh",
    "Axes": ".core._structure",
    "Model": ".core._model",
    "functionalize": ".core._model",
    "grad": ".core._autodiff",
    "init_process_group": ".launch",
    "jit": ".core._jit",
    "make_mesh": ".core._mesh",
    "value_and_grad": ".core._autodiff",
}
_PACKAGES = tuple(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
_TRANSFORMS = tuple(
    m.name for m in pkgutil.iter_modules([os.path.join(__path__[0], "transforms")]) if m.ispkg
)
# Names of DESIGN.md's contract that are not built yet: refused by name, with their issue.
_NOT_BUILT: dict[str, str] = {}

__all__ = [  # kept literal for type checkers; tests/core/test_public_names.py holds it to the above
    "AXIS_ORDER",
    "Axes",
    "Model",
    "checkpoint",
    "cli",
    "context_parallel",
    "core",
    "data",
    "diloco",
    "errors",
    "expert_parallel",
    "fault_tolerant",
    "fp8",
    "functionalize",
    "grad",
    "hf",
    "init_process_group",
    "jit",
    "kernels",
    "launch",
    "losses",
    "make_mesh",
    "models",
    "moe",
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
    if name in _NAMES or name in _TRANSFORMS:
        module = _NAMES.get(name, ".transforms")
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value
    if name in _NOT_BUILT:
        raise AttributeError(f"d9d.{name} is not built yet: {_NOT_BUILT[name]}")
    raise AttributeError(f"module 'd9d' has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*globals(), *__all__]


if TYPE_CHECKING:
    from . import (
        checkpoint,
        cli,
        core,
        data,
        errors,
        hf,
        kernels,
        launch,
        losses,
        models,
        moe,
        optim,
        parallel,
        testing,
        transforms,
        tree,
    )
    from .core._autodiff import grad, value_and_grad
    from .core._jit import jit
    from .core._mesh import AXIS_ORDER, make_mesh
    from .core._model import Model, functionalize
    from .core._structure import Axes
    from .launch import init_process_group
    from .transforms import (
        context_parallel,
        diloco,
        expert_parallel,
        fault_tolerant,
        fp8,
        pipeline,
        remat,
        shard_params,
        tensor_parallel,
    )
