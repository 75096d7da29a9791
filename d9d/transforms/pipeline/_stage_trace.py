"""What a pipeline stage does, for ``step.comms`` and for traces of the schedule.

:class:`TracedStage` is PyTorch's ``PipelineStage`` reporting the bytes it sends and receives
(``send``/``recv`` on the pipeline axis) and, inside :func:`stage_spans`, the spans of its
compute: forward, backward, and the weight-grad half of zero-bubble schedules, whose weight
grads it takes in one backward pass (``_weight_pass.py``). On the meta
device it runs without peers (``d9d plan``'s dry run), and inside :func:`first_backward_only`
it ends the schedule once it has run one backward.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from ... import errors
from ...core._comm_count import record_p2p
from ._weight_pass import one_param_group

__all__ = ["FirstBackwardDone", "TracedStage", "first_backward_only", "span", "stage_spans"]


class _Spans(threading.local):
    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, float, float]] | None = None


_spans = _Spans()


class _Stop(threading.local):
    def __init__(self) -> None:
        self.after_backward = False


_stop = _Stop()


class FirstBackwardDone(BaseException):
    """A stage ran a backward inside :func:`first_backward_only`. A ``BaseException``:
    torch's multi-stage schedules log every ``Exception`` that crosses them as an error
    before raising it again, and this one is no error."""


@contextmanager
def first_backward_only() -> Iterator[None]:
    """Within the block, a stage raises :class:`FirstBackwardDone` once it has run the
    backward of one microbatch: the schedule ends there, on this thread.

    For a dry run on meta whose step cannot finish (``_executor.run_pipeline``): what the
    forward kept is measured at the first backward op (``KeptBytes.before_backward``), and
    the rest of the schedule would run for a count that is thrown away."""
    previous = _stop.after_backward
    _stop.after_backward = True
    try:
        yield
    finally:
        _stop.after_backward = previous


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
    and its compute spans to :func:`stage_spans`."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with span("F", self.stage_index, fwd_chunk_id):
            try:
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            except RuntimeError as error:
                # torch wraps what the forward raised in "[Stage i] failed to run forward";
                # d9d's own errors (an id past the vocab) reach the caller as they are.
                if isinstance(error.__cause__, _D9D_ERRORS):
                    raise error.__cause__ from None
                raise

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with span("B", self.stage_index, bwd_chunk_id):
            out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        if _stop.after_backward:
            raise FirstBackwardDone
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with span("W", self.stage_index, bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        # The weight grads in one backward pass, not one per param group: a block under
        # remat is recomputed once in it, not once per weight (``_weight_pass.py``).
        if backward_type == "weight":
            bwd_kwargs = {**bwd_kwargs, "param_groups": one_param_group(bwd_kwargs["param_groups"])}
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

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
