"""The plan of the transformed step now running on this thread, read by ``Model.apply``.

A ``threading.local`` rather than a ``ContextVar``: Dynamo traces attribute reads of a thread
local but graph-breaks on ``ContextVar.get`` (torch 2.13), and ranks run as threads in tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._plan import Plan

__all__ = ["activate", "active_plan"]

_state = threading.local()


def active_plan() -> Plan | None:
    """The plan of the transformed step running on this thread, or None."""
    return getattr(_state, "plan", None)


@contextmanager
def activate(plan: Plan | None) -> Iterator[None]:
    """Make ``plan`` the active plan for the duration of the block."""
    previous = active_plan()
    _state.plan = plan
    try:
        yield
    finally:
        _state.plan = previous
