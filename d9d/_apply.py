"""``Model.apply`` inside a running step: params gathered per block, runtimes around it.

The params outside blocks are gathered (``_collectives.gather_params``) when ``apply``
starts; a block's params when the block's forward starts, and its slots get the module's
own tensors back when it ends: the core's interception of each block, the innermost one.
Before the forward every runtime's ``enter_apply`` sees the :class:`~d9d._runtime.ApplyCall`
(it may change the inputs, stand modules in, intercept modules and blocks); the forward runs
in the call's environment; ``exit_apply`` runs after it, raised or not. The user's module
carries none of this after ``apply`` returns. With params whose plan says ``regather``
(eager only), gathered params saved for the backward are gathered again there
(``_regather``). With params whose plan says ``prefetch`` (eager only), each block's
all-gather is issued while the block before it computes (``_prefetch``), and in the
backward while the block after it computes (``_regather``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ._collectives import IssuedGather, gather_params
from ._context import StepContext
from ._prefetch import ForwardPrefetch
from ._regather import Regather
from ._runtime import ApplyCall, Interception
from ._structure import Block, Slot, Structure

__all__ = ["apply_in_step"]


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
    # Gathered params are dropped after the forward in eager mode only.
    eager = not torch.compiler.is_compiling()
    regather = Regather(plan, params) if plan.regathers and eager else None
    prefetch = None
    entered = []
    try:
        for runtime in step.runtimes:
            entered.append(runtime)
            runtime.enter_apply(call)
        blocks = [b for b in structure.blocks if not call.stood_in(b.path)]
        if eager:
            units = [(b, _keys(call, b.slots)) for b in blocks]
            rerun = {
                b.path
                for b in blocks
                if any(i.around is not None for i in call.interceptions.get(b.path, ()))
            }
            prefetch = ForwardPrefetch(plan, params, units, rerun)
            prefetch = prefetch if prefetch.active else None
        for block in blocks:
            around = functools.partial(_gathered_block, call, block, regather, prefetch)
            call.intercept(block.path, Interception(around=around))
        running = [s for s in structure.root_slots if not call.stood_in(structure.owner_path(s))]
        locals_ = _gather(call, _keys(call, running), regather)
        if prefetch is not None:
            prefetch.issue_after(None)
        keys = [structure.canonical(s.key) for s in running]
        saved = [slot.swap(locals_[key]) for slot, key in zip(running, keys, strict=True)]
        saved += [slot.swap(buffers[slot.key]) for slot in structure.buffer_slots]
        try:
            with call.environment():
                if regather is None:
                    return structure.module(*call.args, **call.kwargs)
                with torch.autograd.graph.saved_tensors_hooks(regather.pack, regather.unpack):
                    return structure.module(*call.args, **call.kwargs)
        finally:
            for slot, old in zip((*running, *structure.buffer_slots), saved, strict=True):
                slot.swap(old)
    finally:
        if prefetch is not None:
            prefetch.close()
        if regather is not None:
            regather.close()
        for runtime in reversed(entered):
            runtime.exit_apply(call)


def _keys(call: ApplyCall, slots: Sequence[Slot]) -> list[str]:
    """The param paths ``slots`` hold, each tied alias once."""
    return list(dict.fromkeys(call.structure.canonical(s.key) for s in slots))


def _gather(
    call: ApplyCall,
    keys: list[str],
    regather: Regather | None,
    issued: IssuedGather | None = None,
) -> dict[str, Any]:
    """The compute tensors of ``keys`` (unique), waiting for ``issued`` gathers if any."""
    gathered = gather_params(call.plan, keys, call.params, issued)
    if regather is not None:
        regather.track(gathered)
    return gathered


def _gathered_block(
    call: ApplyCall,
    block: Block,
    regather: Regather | None,
    prefetch: ForwardPrefetch | None,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The block's forward with its params gathered into its slots (and the next block's
    gather issued before it computes)."""
    slots: tuple[Slot, ...] = block.slots
    # Taken inline: no frame of this one keeps the issued buffer alive past the gather.
    locals_ = _gather(
        call, _keys(call, slots), regather, None if prefetch is None else prefetch.take(block)
    )
    if prefetch is not None:
        prefetch.issue_after(block)
    keys = [call.structure.canonical(s.key) for s in slots]
    saved = [slot.swap(locals_[key]) for slot, key in zip(slots, keys, strict=True)]
    try:
        return forward(*args, **kwargs)
    finally:
        for slot, old in zip(slots, saved, strict=True):
            slot.swap(old)
