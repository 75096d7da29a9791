"""``get_state``: read a named field (``learning_rate``, ``count``, ...) of an optimizer state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from d9d.errors import UnknownStateNameError

__all__ = ["get_state"]

_ALIASES = {"step": "count"}


def _fields(state: Any) -> Iterator[tuple[str, Any]]:
    """``(field name, value)`` of every NamedTuple in ``state``, depth first, in chain order.

    Walks NamedTuples, tuples and lists (what ``chain`` and ``masked`` build); dicts are
    per-param trees (``mu={path: tensor}``) and are not searched.
    """
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        for name, value in zip(state._fields, state, strict=True):
            yield name, value
            yield from _fields(value)
    elif isinstance(state, tuple | list):
        for value in state:
            yield from _fields(value)


def get_state(state: Any, name: str) -> Any:
    """The value of the first state field called ``name``, searching nested chains and masks.

    Fields are the NamedTuple fields of the primitives' states (``ScaleByAdamState.mu``,
    ``ScaleByLearningRateState.learning_rate``, ...), searched depth first in ``chain``
    order; ``"step"`` is another name for ``"count"``. Each stateful primitive counts every
    update, so the first ``count`` found is the number of updates done so far.

    Args:
        state: an optimizer state (the output of ``init`` or ``update``).
        name: a field name, e.g. ``"learning_rate"``, ``"count"`` or ``"step"``.

    Returns:
        The field's value: ``learning_rate`` is the 0-d float32 tensor the last update
        applied; ``count`` a 0-d int64 tensor; ``mu`` a tree laid out like the params.

    Raises:
        UnknownStateNameError: no field is called ``name``; the message lists the names there are.

    Example:
        >>> import torch, d9d.optim as optim
        >>> opt = optim.adamw(optim.linear_warmup(1.0, 10))
        >>> params = {"w": torch.zeros(2)}
        >>> _, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> optim.get_state(state, "learning_rate"), optim.get_state(state, "step")
        (tensor(0.), tensor(1))
    """
    field = _ALIASES.get(name, name)
    names = []
    for found, value in _fields(state):
        if found == field:
            return value
        names.append(found)
    available = sorted(set(names) | {alias for alias, f in _ALIASES.items() if f in names})
    raise UnknownStateNameError(
        f"no optimizer state field is called {name!r}; this state has {available}. "
        "learning_rate exists when the optimizer has scale_by_learning_rate (every alias does)"
    )
