"""``assert_max_traces``: fail when a compiled function is traced more often than allowed."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch._dynamo.utils import counters

__all__ = ["assert_max_traces"]


def assert_max_traces(fn: Callable[..., Any] | None = None, *, n: int) -> Any:
    """Wrap a compiled function (a ``d9d.jit`` step or a ``torch.compile`` result) so that a
    call which traces it for the ``n + 1``-th time raises ``AssertionError``.

    A call counts as a trace when Dynamo compiled at least one new graph during it (read from
    Dynamo's ``unique_graphs`` counter), so a recompile caused by a changed shape, dtype or
    Python value is caught on the call that causes it.

    Args:
        fn: The function to watch; omit it to use ``assert_max_traces(n=...)`` as a decorator.
        n: The number of traces allowed (>= 1).

    Returns:
        The wrapped function; ``wrapped.traces`` is the count so far.

    Raises:
        ValueError: ``n`` is not a positive int.

    Example:
        >>> import torch
        >>> double = assert_max_traces(torch.compile(lambda x: 2 * x, backend="eager"), n=1)
        >>> double(torch.ones(2)).tolist(), double(torch.zeros(2)).tolist(), double.traces
        ([2.0, 2.0], [0.0, 0.0], 1)
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"assert_max_traces needs n >= 1 traces, got {n=}")

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            before = counters["stats"]["unique_graphs"]
            out = f(*args, **kwargs)
            if counters["stats"]["unique_graphs"] != before:
                wrapped.traces += 1
                if wrapped.traces > n:
                    name = getattr(f, "__name__", type(f).__name__)
                    raise AssertionError(
                        f"{name!r} was traced {wrapped.traces} times, at most {n} allowed: a "
                        "call changed an input's shape, dtype, device or a Python value the "
                        "graph depends on"
                    )
            return out

        wrapped.traces = 0
        return wrapped

    return wrap if fn is None else wrap(fn)
