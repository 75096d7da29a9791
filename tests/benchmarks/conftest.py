"""The benchmark scripts, loaded as modules (``benchmarks/`` is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def load_benchmark() -> Callable[[str], ModuleType]:
    """``load_benchmark("mfu")``: ``benchmarks/mfu.py`` as a module, with ``benchmarks/`` on
    ``sys.path`` as when the script runs (``from report import ...``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(
            f"benchmark_{name}", BENCHMARKS / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
