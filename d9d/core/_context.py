"""The running step: one :class:`StepContext` per call of a transformed step, on its thread.

Everything one step's execution shares lives here: the plan, the transforms' runtimes,
whether grads are being accumulated, and the token counts the loss records. Held by a ``threading.local`` rather than a ``ContextVar``: Dynamo traces
attribute reads of a thread local but graph-breaks on ``ContextVar.get`` (torch 2.13), and
ranks run as threads in tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._plan import Plan

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = [
    "StepContext",
    "count_tokens",
    "current",
    "differentiating",
    "record_step_tokens",
    "record_tokens",
    "running",
    "sequence_attention",
    "step_op",
    "watching_steps",
]


@dataclass(eq=False)
class StepContext:
    """One running step.

    Attributes:
        plan: The step's plan.
        runtimes: The transforms' runtimes, in transform order.
        defer_reduction: Gathered params' backward leaves grads unreduced (``Partial``), as
            while accumulating microbatches; the accumulation reduces them once.
        token_counts: While a loss's token counts are collected, the list they go to.
        sequence_groups: While a position-wise module runs on this rank's part of each
            sequence (``Structure.position_wise``; set by the runtime that split it), the
            ``(process group name, ranks)`` of each axis whose ranks hold the other parts.
            Unlike ``plan.token_groups`` these ranks all compute the same loss and sum their
            grads: a module sums its statistics over them and returns per-token terms as
            this rank's share (``d9d.moe`` does).
        codec_statistics: ``{path: all-reduced statistic}`` of the stored params whose gather
            codec has one (an fp8 weight's amax), taken once as the step starts: a stored
            shard does not change within a step, so every gather of it in the step (each
            unit's, the backward's regather, each microbatch's) encodes with the same value.
        differentiated: While ``value_and_grad`` runs its function, ``(given, leaf)`` for
            each tensor it differentiates: the tensor it was given and the autograd leaf it
            made of it (a detached alias), so that a runtime can tell its own tensors in
            what ``apply`` receives by identity (ZeRO-1/2's slices), which Dynamo traces
            where it cannot compare data pointers (:func:`differentiating`).
        applied: Weak references to the ``ApplyCall`` each ``Model.apply`` made, each
            released (its references to itself dropped) when the eager step returns, or
            the ``value_and_grad`` or microbatch backward it was made in is done
            (``_apply.released_calls``); None under ``d9d.jit``.
        tokens: The valid tokens the step's differentiated losses counted, summed over its
            ``value_and_grad`` calls and microbatches, each count over every rank that holds
            other tokens (:func:`record_step_tokens`); None while none was counted, and when
            no wrapper watches the step. What a wrapper that weighs whole steps against each
            other reads once the call returns (:func:`watching_steps`).
    """

    plan: Plan
    runtimes: tuple[Runtime, ...] = ()
    defer_reduction: bool = False
    token_counts: list[torch.Tensor] | None = None
    sequence_groups: tuple[tuple[str, int], ...] = ()
    codec_statistics: dict[str, torch.Tensor] | None = None
    differentiated: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    applied: list[Any] | None = None
    tokens: torch.Tensor | None = None

    @property
    def wide_grads(self) -> bool:
        """A runtime reduces the grads further (over replica groups) in their reduce dtype
        where it is wider than the param's (``Runtime.widens_grads``): ``value_and_grad``, or
        the runtime driving it (``Differentiation.leaves``), then differentiates such a param
        as a copy in it, as while deferring reductions, and rounds its grad once, after the
        reductions."""
        return any(runtime.widens_grads for runtime in self.runtimes)


class _State(threading.local):
    """Set up fresh in each thread, so Dynamo's guards see the same attributes every call."""

    def __init__(self) -> None:
        self.step: StepContext | None = None
        self.watched: list[StepContext] | None = None


_state = _State()


def current() -> StepContext | None:
    """The step running on this thread, or None."""
    return _state.step


@contextmanager
def running(step: StepContext | None) -> Iterator[StepContext | None]:
    """Make ``step`` the running step for the duration of the block."""
    previous = _state.step
    _state.step = step
    if step is not None and _state.watched is not None:
        _state.watched.append(step)
    try:
        yield step
    finally:
        _state.step = previous


@contextmanager
def count_tokens() -> Iterator[list[torch.Tensor]]:
    """Within the block, the global valid-token counts that token means record (one 0-d
    tensor per call of :func:`d9d.losses.token_mean`) are appended to the yielded list."""
    step = _state.step
    counts: list[torch.Tensor] = []
    if step is None:
        yield counts
        return
    previous = step.token_counts
    step.token_counts = counts
    try:
        yield counts
    finally:
        step.token_counts = previous


@contextmanager
def watching_steps() -> Iterator[list[StepContext]]:
    """Within the block, the context of each step that starts running on this thread is
    appended to the yielded list, so that a wrapper calling a step reads what the step
    recorded there (its ``tokens``) once the call returns, under ``d9d.jit`` too."""
    previous = _state.watched
    _state.watched = watched = []
    try:
        yield watched
    finally:
        _state.watched = previous


@contextmanager
def differentiating(given: list[torch.Tensor], leaves: list[torch.Tensor]) -> Iterator[None]:
    """Within the block, the running step's ``differentiated`` also holds ``leaves``, the
    autograd leaves made of ``given``. Set back when it ends: a compiled step then returns
    no extra tensors for Dynamo to hand back to it."""
    step = _state.step
    if step is None:
        yield
        return
    previous = step.differentiated
    step.differentiated = previous + tuple(zip(given, leaves, strict=True))
    try:
        yield
    finally:
        step.differentiated = previous


def record_tokens(count: torch.Tensor) -> None:
    """Record a token mean's global count of valid tokens, if a :func:`count_tokens` block
    is open (``value_and_grad`` opens one per microbatch to weigh it)."""
    step = _state.step
    if step is not None and step.token_counts is not None:
        step.token_counts.append(count)


def record_step_tokens(counts: list[torch.Tensor]) -> None:
    """Add ``counts``, the valid tokens a differentiated loss counted (each the same on every
    rank that holds other tokens), to the running step's ``tokens``, while a wrapper watches
    the step (:func:`watching_steps`): else nothing is computed or kept, so that a step
    nobody weighs holds what it held before (``tests/distributed/test_accumulated_bytes.py``
    counts its bytes)."""
    step = _state.step
    if step is not None and _state.watched is not None and counts:
        count = torch.stack(counts).sum()
        step.tokens = count if step.tokens is None else step.tokens + count


def sequence_attention() -> Callable[..., Any] | None:
    """The attention the running step substitutes for attention over the local sequence
    (its ``"attention"`` op: ring attention), or None.

    Model code asks it: ``attend(q, k, v, causal=..., scale=...)`` over ``[B, H, S, D]``.
    """
    return step_op("attention")


def sequence_length(local: int) -> int:
    """The length of the whole sequence of which the running step gives the model ``local``
    positions (its ``"sequence_length"`` op: ``local`` times the cp size), else ``local``."""
    whole = step_op("sequence_length")
    return local if whole is None else whole(local)


def step_op(name: str) -> Callable[..., Any] | None:
    """The op ``name`` a runtime of the running step substitutes (``Runtime.op``), or None."""
    step = _state.step
    if step is None:
        return None
    for runtime in step.runtimes:
        op = runtime.op(name)
        if op is not None:
            return op
    return None
