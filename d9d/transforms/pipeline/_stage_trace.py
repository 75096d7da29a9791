"""What a pipeline stage does, for ``step.comms`` and for traces of the schedule.

:class:`TracedStage` is PyTorch's ``PipelineStage`` reporting the bytes it sends and receives
(``send``/``recv`` on the pipeline axis) and, inside :func:`stage_spans`, the spans of its
compute: forward, backward, and the weight-grad half of zero-bubble schedules, whose weight
grads it takes in one backward pass (``_weight_pass.py``). On the meta
device it runs without peers (``d9d plan``'s dry run), and inside :func:`sampled_actions` it
counts the first microbatch of each of its actions and ends the schedule once all have run.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from ... import errors
from ...core._comm_count import CommStats, add_counts, record_p2p, recording_into
from ._weight_pass import one_param_group

__all__ = [
    "ScheduleSampled",
    "TracedStage",
    "run_sampled",
    "sampled_actions",
    "span",
    "stage_spans",
]


class _Spans(threading.local):
    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, float, float]] | None = None


_spans = _Spans()


class _Sampling(threading.local):
    def __init__(self) -> None:
        self.units: dict[tuple[int, str], CommStats] | None = None
        self.needed: frozenset[tuple[int, str]] = frozenset()


_sampling = _Sampling()


class ScheduleSampled(BaseException):
    """Every action :func:`sampled_actions` waits for has run once. A ``BaseException``:
    torch's multi-stage schedules log every ``Exception`` that crosses them as an error
    before raising it again, and this one is no error."""


@contextmanager
def sampled_actions(
    needed: frozenset[tuple[int, str]],
) -> Iterator[dict[tuple[int, str], CommStats]]:
    """Within the block, the first run of each ``(stage, kind)`` of ``needed`` (kind ``F``
    forward, ``B`` backward, ``W`` weight grads) counts its collectives into a
    :class:`CommStats` of the dict yielded; once all have run, the stage raises
    :class:`ScheduleSampled` and the schedule ends there, on this thread. Sends and
    receives between stages are left to the caller.

    For a dry run on meta (``_executor.run_pipeline``): every microbatch of a stage moves
    what its first one did (same shapes; ``d9d plan`` assumes uniform routing), so the
    schedule's collectives are these counts times the microbatches, and what the forward
    kept is measured at the first backward op (``KeptBytes.before_backward``)."""
    previous = _sampling.units, _sampling.needed
    units: dict[tuple[int, str], CommStats] = {}
    _sampling.units, _sampling.needed = units, needed
    try:
        yield units
    finally:
        _sampling.units, _sampling.needed = previous


def run_sampled(
    schedule: Any,
    shapes: dict[int, Any],
    layout: Any,
    count: int,
    zero_bubble: bool,
    **step_kwargs: Any,
) -> None:
    """Run ``schedule`` (of ``layout``, a ``PipelineLayout``) over ``count`` microbatches
    (``step_kwargs``: the last stage's ``target`` and ``losses``, where this rank holds it)
    until each local stage has run each of its actions once, and count the whole schedule
    from those: each action's collectives ``count`` times, and per microbatch a send or
    receive of each tensor crossing to a stage on another rank (forward: the activation
    or carried state, from the probe's ``shapes``; backward: its grad), as
    :class:`TracedStage` counts them. The schedule's own counts are dropped."""
    kinds = ("F", "B", "W") if zero_bubble else ("F", "B")
    needed = frozenset((s, kind) for s in layout.local_stages for kind in kinds)
    with (
        recording_into(None),
        sampled_actions(needed) as units,
        contextlib.suppress(ScheduleSampled),
    ):
        schedule.step(mb=torch.arange(count), **step_kwargs)
    missing = sorted(needed - units.keys())
    if missing:  # a schedule whose first actions differ from its later ones is not sampled
        raise errors.DryRunError(
            f"the dry run of pipeline schedule {layout.schedule!r} on rank {layout.rank} "
            f"never ran (stage, action) {missing}, so it cannot count the schedule from its "
            "first microbatch; plan this layout with the last stage on this rank or without "
            "aux outputs"
        )
    for unit in units.values():
        add_counts(unit, count)
    last = layout.split.count - 1
    for s in layout.local_stages:
        entering, leaving = shapes[s]
        for crossing, tensors, forward in (
            (s > 0 and layout.owner(s - 1) != layout.rank, entering, "recv"),
            (s < last and layout.owner(s + 1) != layout.rank, leaving, "send"),
        ):
            if not crossing:
                continue
            backward = "send" if forward == "recv" else "recv"
            for shape, dtype in tensors:
                nbytes = math.prod(shape) * dtype.itemsize
                for _ in range(count):
                    record_p2p(forward, layout.axis, nbytes)
                    if dtype.is_floating_point:
                        record_p2p(backward, layout.axis, nbytes)


@contextmanager
def _action(kind: str, stage: int, microbatch: int) -> Iterator[None]:
    """One stage action: a span, and under :func:`sampled_actions` its count."""
    units = _sampling.units
    if units is None or (stage, kind) in units or (stage, kind) not in _sampling.needed:
        with span(kind, stage, microbatch):
            yield
        return
    units[(stage, kind)] = CommStats()
    with span(kind, stage, microbatch), recording_into(units[(stage, kind)]):
        yield
    if _sampling.needed <= units.keys():
        raise ScheduleSampled


@contextmanager
def stage_spans() -> Iterator[list[tuple[str, int, int, float, float]]]:
    """Record this thread's stage compute while the block runs: a list that fills with
    ``(kind, stage, microbatch, start, end)`` (``time.perf_counter`` seconds; kind ``F``
    forward, ``B`` backward, ``W`` weight grads of a zero-bubble schedule, and one
    ``schedule`` span around the whole schedule, with stage -1). Schedule time outside the
    compute spans is waiting: the pipeline's bubble (``benchmarks/pipeline.py``)."""
    previous = _spans.events
    _spans.events = []
    try:
        yield _spans.events
    finally:
        _spans.events = previous


@contextmanager
def span(kind: str, stage: int, microbatch: int) -> Iterator[None]:
    """Record the block as one span while :func:`stage_spans` is on."""
    events = _spans.events
    if events is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        events.append((kind, stage, microbatch, start, time.perf_counter()))


_D9D_ERRORS = tuple(getattr(errors, name) for name in errors.__all__)


class TracedStage(pipelining.PipelineStage):
    """A ``PipelineStage`` that reports the bytes it sends and receives to ``step.comms``
    and its compute spans to :func:`stage_spans`; ``after_weight_pass`` runs after each
    zero-bubble weight pass (the executor moves the grads into their sums there)."""

    after_weight_pass: Callable[[], None] = staticmethod(lambda: None)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with _action("F", self.stage_index, fwd_chunk_id):
            try:
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            except RuntimeError as error:
                # torch wraps what the forward raised in "[Stage i] failed to run forward";
                # d9d's own errors (an id past the vocab) reach the caller as they are.
                if isinstance(error.__cause__, _D9D_ERRORS):
                    raise error.__cause__ from None
                raise

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with _action("B", self.stage_index, bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with _action("W", self.stage_index, bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        # The weight grads in one backward pass, not one per param group: a block under
        # remat is recomputed once in it, not once per weight (``_weight_pass.py``).
        if backward_type != "weight":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        bwd_kwargs = {**bwd_kwargs, "param_groups": one_param_group(bwd_kwargs["param_groups"])}
        out = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # torch's weight pass adds the grads to ``.grad`` itself, firing no grad hook.
        self.after_weight_pass()
        return out

    # torch 2.13's schedules open with a vote passed down the stages and back: STATIC (1)
    # when every stage has fixed shapes without DTensors, as every d9d stage has. On meta
    # (a dry run on a simulated world) no peer answers, so the stage casts the known result.
    def _warmup_forward_vote(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.device.type == "meta":
            return torch.ones(1, dtype=torch.int32)
        return super()._warmup_forward_vote(*args, **kwargs)

    def _warmup_backward_result(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.device.type == "meta":
            return torch.ones(1, dtype=torch.int32)
        return super()._warmup_backward_result(*args, **kwargs)

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        # Before its first step torch 2.11 sends a value to each neighbour stage, to open
        # the links, also to its own rank when that holds the neighbour (the V of zbv),
        # which gloo refuses ("Pair is not connected"). A rank needs no link to itself.
        rank = dist.get_rank()
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.peer != rank]

    def _count(self, kind: str, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        if _sampling.units is not None:  # counted per microbatch by the executor
            return ops
        for op in ops:
            record_p2p(kind, self.axis_name, op.tensor.numel() * op.tensor.element_size())
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count("send", super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count("send", super().get_bwd_send_ops(bwd_chunk_id))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count("recv", super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count("recv", super().get_bwd_recv_ops(bwd_chunk_id))
