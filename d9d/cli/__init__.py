"""The ``d9d`` command line: ``d9d train``, ``d9d plan``, ``d9d bench kernels``."""

from ._main import main as main

__all__ = ["main"]
