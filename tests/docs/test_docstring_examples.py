"""Every public function has a docstring Example, and every Example of the public API runs
(STYLE.md: "a short Example that runs on one CPU").

The public API is ``d9d.__all__`` and the ``__all__`` of each package it names. An Example runs
as ``doctest.testmod`` runs it, in its module's namespace. Nothing ran them before: the one of
``d9d.kernels.dispatch`` used ``torch`` without importing it, and the directive of
``d9d.init_process_group``'s (``# doctest: +SKIP  (inside ...)``) was one doctest cannot parse.
"""

from __future__ import annotations

import doctest
import inspect
import sys
from typing import Any

import pytest

import d9d


def _public() -> dict[str, Any]:
    """``{dotted name: object}`` of every public name, each object once."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    for name in d9d.__all__:
        value = getattr(d9d, name)
        members = (
            [(f"d9d.{name}.{m}", getattr(value, m)) for m in getattr(value, "__all__", ())]
            if inspect.ismodule(value)
            else [(f"d9d.{name}", value)]
        )
        for dotted, member in members:
            if id(member) not in seen and (inspect.isfunction(member) or inspect.isclass(member)):
                seen.add(id(member))
                found[dotted] = member
    return found


PUBLIC = _public()


def _examples() -> list[Any]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    params = []
    for dotted, member in PUBLIC.items():
        module = sys.modules[member.__module__]
        try:
            tests = finder.find(member, dotted, module=module, globs=vars(module))
        except ValueError as error:  # a docstring doctest cannot parse: that test fails
            params.append(pytest.param(error, id=dotted))
            continue
        params.extend(pytest.param(t, id=t.name) for t in tests if t.name.startswith(dotted))
    return params


@pytest.fixture
def kernel_backends_restored():
    """The kernel registry as it was: ``register_backend``'s Example registers a backend, and
    the registry is process-wide (a later test in this worker listed it among swiglu's)."""
    from d9d.kernels import _registry

    saved = {name: dict(op.backends) for name, op in _registry._OPS.items()}
    yield
    for name, op in _registry._OPS.items():
        op.backends = saved.get(name, op.backends)


@pytest.mark.usefixtures("kernel_backends_restored")
@pytest.mark.parametrize("test", _examples())
def test_every_public_docstring_example_runs(test: doctest.DocTest | ValueError) -> None:
    if isinstance(test, ValueError):
        pytest.fail(f"doctest cannot parse the docstring: {test}")
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    assert runner.run(test, out=report.append).failed == 0, "".join(report)


def test_every_public_function_and_top_level_class_has_an_example() -> None:
    # Classes of the subpackages (states, handles, transforms' frozen dataclasses) are built
    # by the functions that return them, whose Examples show them; d9d.Model had none.
    lacking = [
        dotted
        for dotted, member in PUBLIC.items()
        if (inspect.isfunction(member) or dotted.count(".") == 1)
        and ">>>" not in (inspect.getdoc(member) or "")
    ]
    assert not lacking, f"public names without a docstring Example: {lacking}"
