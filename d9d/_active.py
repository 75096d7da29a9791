"""The plan of the transformed step now running on this thread, read by ``Model.apply``,
and the valid-token counts its loss records for weighing microbatches.

A ``threading.local`` rather than a ``ContextVar``: Dynamo traces attribute reads of a thread
local but graph-breaks on ``ContextVar.get`` (torch 2.13), and ranks run as threads in tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ._plan import Plan

__all__ = [
    "accumulate",
    "accumulating",
    "activate",
    "active_plan",
    "count_tokens",
    "record_tokens",
]


class _State(threading.local):
    """Set up fresh in each thread, so Dynamo's guards see the same attributes every call."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.accumulating = False
        self.token_counts: list[torch.Tensor] | None = None


_state = _State()


def active_plan() -> Plan | None:
    """The plan of the transformed step running on this thread, or None."""
    return _state.plan


@contextmanager
def activate(plan: Plan | None) -> Iterator[None]:
    """Make ``plan`` the active plan for the duration of the block."""
    previous = active_plan()
    _state.plan = plan
    try:
        yield
    finally:
        _state.plan = previous


def accumulating() -> bool:
    """Whether grads are being accumulated over microbatches (reduced once, at the end)."""
    return _state.accumulating


@contextmanager
def accumulate() -> Iterator[None]:
    """Within the block, gathered params' backward leaves grads unreduced (``Partial``)."""
    previous = _state.accumulating
    _state.accumulating = True
    try:
        yield
    finally:
        _state.accumulating = previous


@contextmanager
def count_tokens() -> Iterator[list[torch.Tensor]]:
    """Within the block, the global valid-token counts that token means record (one 0-d
    tensor per call of :func:`d9d.losses.token_mean`) are appended to the yielded list."""
    previous = _state.token_counts
    counts: list[torch.Tensor] = []
    _state.token_counts = counts
    try:
        yield counts
    finally:
        _state.token_counts = previous


def record_tokens(count: torch.Tensor) -> None:
    """Record a token mean's global count of valid tokens, if a :func:`count_tokens` block
    is open (``value_and_grad`` opens one per microbatch to weigh it)."""
    if _state.token_counts is not None:
        _state.token_counts.append(count)
