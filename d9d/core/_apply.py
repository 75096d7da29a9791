"""``Model.apply`` inside a running step: params gathered per block, runtimes around it.

The params outside blocks are gathered when ``apply`` starts; a block's params when the
block's forward starts, and its slots get the module's own tensors back when it ends: the
core's interception of each block, the innermost one. Both gathers go through the call's
``gather`` (:func:`_gather.gather_params` unless a runtime put its own in). Before the
forward every runtime's ``enter_apply`` sees the :class:`~d9d.core._runtime.ApplyCall` (it may
change the inputs, stand modules in, intercept modules and blocks, take the gathers over,
add contexts around the forward); the forward runs in the call's environment, inside those
contexts; ``exit_apply`` runs after it, raised or not. The user's module carries none of
this after ``apply`` returns.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ._context import StepContext
from ._gather import gather_params
from ._runtime import ApplyCall, Interception
from ._structure import Block, Slot, Structure

__all__ = ["apply_in_step", "held", "released_calls"]


def apply_in_step(
    step: StepContext,
    structure: Structure,
    params: Mapping[str, Any],
    buffers: Mapping[str, torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The forward of ``structure.module`` on ``params`` under the running ``step``."""
    plan = step.plan
    call = ApplyCall(structure, plan, params, args, dict(kwargs))
    call.gather = functools.partial(_gather_now, call)
    if step.applied is not None:  # weakly: tracked, a call must not live longer
        step.applied.append(weakref.ref(call))
    entered = []
    try:
        for runtime in step.runtimes:
            entered.append(runtime)
            runtime.enter_apply(call)
        for block in call.blocks():
            around = functools.partial(_gathered_block, call, block)
            call.innermost[block.path] = Interception(around=around)
        running = [s for s in structure.root_slots if not call.stood_in(structure.owner_path(s))]
        keys = [structure.canonical(s.key) for s in running]
        locals_ = call.gather(None, list(dict.fromkeys(keys)))  # distinct, in slot order
        tensors = [held(locals_[key], key, structure) for key in keys]
        saved = [slot.swap(t) for slot, t in zip(running, tensors, strict=True)]
        saved += [slot.swap(buffers[slot.key]) for slot in structure.buffer_slots]
        try:
            with call.environment():
                return _forward_within(call.contexts, structure.module, call.args, call.kwargs)
        finally:
            for slot, old in zip((*running, *structure.buffer_slots), saved, strict=True):
                slot.swap(old)
    finally:
        for runtime in reversed(entered):
            runtime.exit_apply(call)


@contextmanager
def released_calls(step: StepContext | None, release: bool) -> Iterator[None]:
    """With ``release``, each call ``apply`` makes under ``step`` within the block and still
    alive when the block ends drops its params, inputs, gather, interceptions and contexts
    then (eager only: an eager step, a ``value_and_grad``, a microbatch's forward and
    backward; no recomputation needs them after).

    A call is a reference cycle (its gather, its blocks' interceptions and the runtimes'
    state for it hold it), which only Python's cyclic collector frees: it held the step's
    stored params past the step (the aliases ``value_and_grad`` differentiates: a second
    copy of the rank's params once the caller replaced them), what a pipeline stage's
    calls held through the update (537,600 B on rank 0 of the tiny Llama, pp=2 x fsdp=2),
    and a microbatch's float32 copies of bf16 params (``_autodiff._summed_wider``) through
    the next microbatch. Calls are tracked by weak reference, so none lives longer for
    being tracked."""
    if step is None or not release:
        yield
        return
    previous, step.applied = step.applied, []
    try:
        yield
    finally:
        refs, step.applied = step.applied, previous
        for call in (ref() for ref in refs):
            if call is not None:
                call.params, call.args, call.kwargs, call.state = {}, (), {}, {}
                call.gather, call.interceptions, call.innermost = None, {}, {}
                call.contexts = []


def held(tensor: Any, key: str, structure: Structure) -> Any:
    """What the slot of the param at ``key`` holds for the forward: ``tensor``, detached if
    the param was built with ``requires_grad=False`` (``Structure.frozen``), so that, as in
    torch, no grad reaches it (``value_and_grad`` gives it zeros). Detached here, after its
    gather, so that runtimes still know the param they were given by identity."""
    return tensor.detach() if key in structure.frozen else tensor


def _forward_within(
    contexts: list[Any], module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``module(*args, **kwargs)`` inside ``contexts``, the first outermost (nested ``with``
    blocks, not an ``ExitStack``, which Dynamo traces poorly)."""
    if not contexts:
        return module(*args, **kwargs)
    with contexts[0]:
        return _forward_within(contexts[1:], module, args, kwargs)


def _gather_now(call: ApplyCall, block: Block | None, keys: list[str]) -> dict[str, Any]:
    """The compute tensors of ``keys``, gathered now."""
    del block
    return gather_params(call.plan, keys, call.params)


def _gathered_block(
    call: ApplyCall,
    block: Block,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The block's forward with its params gathered into its slots."""
    slots: tuple[Slot, ...] = block.slots
    keys = [call.structure.canonical(s.key) for s in slots]
    locals_ = call.gather(block, list(dict.fromkeys(keys)))  # distinct, in slot order
    tensors = [held(locals_[key], key, call.structure) for key in keys]
    saved = [slot.swap(t) for slot, t in zip(slots, tensors, strict=True)]
    try:
        return forward(*args, **kwargs)
    finally:
        for slot, old in zip(slots, saved, strict=True):
            slot.swap(old)
