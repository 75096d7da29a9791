"""``shard_params`` at run time: when each block's params are gathered, and microbatches.

Inside one ``Model.apply`` the core gathers the params outside blocks when the forward
starts and a block's params when the block starts, through the call's ``gather``. This
runtime takes that ``gather`` over (eager only, but for ZeRO-1/2's: under
``torch.compile`` the compiler schedules the collectives, and with ``regather`` the runtime's
graph pass gathers again for the backward, :mod:`._regather_graph`):

- with params whose :class:`~._schedule.Schedule` says ``prefetch``, each block's
  all-gather is issued while the block before it computes (:mod:`._prefetch`);
- with params whose schedule says ``regather``, saved-tensor hooks drop the gathered copies
  autograd saves and gather them again in the backward, issuing the gather of the block
  before early (:mod:`._regather`).

With ``microbatches > 1`` it drives ``d9d.value_and_grad`` (:mod:`._accumulate`). Under
ZeRO-1/2 the step body sees slices of params stored whole, and their updates are gathered
back when it returns (:mod:`._zero`); a pipeline stage, which gathers once per step, gets
the whole stored params too (``gather_once``). With the optimizer state on the host it checks, at
the first step, that the optimizer updates there (:mod:`._host_state`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from ...core._gather import gather_params
from ...core._plan import Plan
from ...core._runtime import ApplyCall, Differentiation, Runtime
from ...core._structure import Block
from ._accumulate import accumulate
from ._host_state import check_offloaded
from ._prefetch import ForwardPrefetch
from ._regather import Regather
from ._regather_graph import marked_gather, regather
from ._schedule import schedule_of
from ._zero import Zero

__all__ = ["ShardParamsRuntime"]


class ShardParamsRuntime(Runtime):
    """The runtime of ``shard_params`` on ``plan``."""

    def __init__(self, plan: Plan, microbatches: int, opt_state_device: str | None = None) -> None:
        self.microbatches = microbatches
        self.opt_state_device = opt_state_device
        self.checked_optimizer = opt_state_device is None
        zero = Zero(plan)
        self.zero = zero if zero.paths else None
        self.drives_differentiation = microbatches > 1
        self.accumulates_grads = microbatches > 1  # deferred: reduced once (_accumulate)
        self.defers_reduction = microbatches > 1
        schedules = {p: schedule_of(plan.entries[p]) for p in plan.held}
        # Read once here: the gathers ask per param and per call.
        self.again = frozenset(p for p, s in schedules.items() if s.regather)
        self.early = frozenset(p for p, s in schedules.items() if s.prefetch)
        self.regathers = any(plan.entries[p].compute != plan.entries[p].storage for p in self.again)

    def start_step(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        if not self.checked_optimizer:  # once: the state's structure does not change
            check_offloaded(opt_state, self.opt_state_device)
            self.checked_optimizer = True
        return params, opt_state

    def enter_step(self, params: Any) -> Any:
        return params if self.zero is None else self.zero.enter_step(params)

    def exit_step(self, params: Any) -> Any:
        return params if self.zero is None else self.zero.exit_step(params)

    def gather_once(self, paths: list[str], params: dict[str, Any]) -> dict[str, Any] | None:
        """Under ZeRO-1/2, the whole stored params of the slices the body was given (no
        all-gather), their grads reduced in one collective per group once the driver's
        microbatches are summed (a pipeline stage's); else the core's gather."""
        return None if self.zero is None else self.zero.gather(paths, params)

    def jit_refusal(self) -> str | None:
        if self.opt_state_device is not None:
            return (
                f"shard_params(opt_state_device={self.opt_state_device!r}) runs eagerly: the "
                "host update's copies and its synchronization are not traced; keep the "
                "optimizer state on the device (opt_state_device=None) under d9d.jit, or "
                "drop d9d.jit"
            )
        return None

    def graph_passes(self) -> tuple[Callable[[fx.GraphModule], fx.GraphModule], ...]:
        """Under ``d9d.jit``, the backward's reads of gathered params gathered again
        (:mod:`._regather_graph`), when params say ``regather``."""
        return (regather,) if self.regathers else ()

    def differentiate(
        self, job: Differentiation
    ) -> tuple[torch.Tensor, Any, list[Any], torch.Tensor | None]:
        return accumulate(job, self.microbatches)

    def enter_apply(self, call: ApplyCall) -> None:
        if torch.compiler.is_compiling():
            if self.zero is not None:
                call.gather = functools.partial(_zero_gather, self.zero, call)
            elif self.regathers:
                call.gather = functools.partial(marked_gather, call.gather)
            return
        regather = (
            Regather(call.plan, call.params, self.again, self.early) if self.regathers else None
        )
        boundary = _Boundary(call, regather, self.early, self.zero)
        call.state[self] = boundary
        call.gather = boundary.gather
        if boundary.regather is not None:
            hooks = torch.autograd.graph.saved_tensors_hooks
            call.within(hooks(boundary.regather.pack, boundary.regather.unpack))

    def exit_apply(self, call: ApplyCall) -> None:
        boundary = call.state.pop(self, None)
        if boundary is not None:
            boundary.close()


class _Boundary:
    """One call's gathers: each unit's, waiting for one issued ahead, issuing the next."""

    def __init__(
        self,
        call: ApplyCall,
        regather: Regather | None,
        early: frozenset[str],
        zero: Zero | None,
    ) -> None:
        self.call = call
        self.zero = zero
        self.early = early
        self.regather = regather
        self.prefetch: ForwardPrefetch | None = None
        self.started = False

    def gather(self, unit: Block | None, keys: list[str]) -> dict[str, Any]:
        """The compute tensors of ``keys``, the params of ``unit`` (None: those outside
        blocks, gathered first, once every runtime has entered the call)."""
        if not self.started:
            self.started = True
            self.prefetch = _forward_prefetch(self.call, self.early)
        if self.zero is not None:
            return self.zero.gather(keys, self.call.params)
        prefetch = self.prefetch
        # Taken inline: no frame of this one keeps the issued buffer alive past the gather.
        gathered = gather_params(
            self.call.plan,
            keys,
            self.call.params,
            None if prefetch is None or unit is None else prefetch.take(unit),
        )
        if self.regather is not None:
            self.regather.track(gathered)
        if prefetch is not None:
            prefetch.issue_after(unit)
        return gathered

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
        if self.regather is not None:
            self.regather.close()


def _zero_gather(zero: Zero, call: ApplyCall, unit: Block | None, keys: list[str]) -> Any:
    """The compute tensors of ``keys`` under ZeRO-1/2 in a compiled step: the whole stored
    params, their grads reduced per block (no prefetch or regather to schedule)."""
    del unit
    return zero.gather(keys, call.params)


def _forward_prefetch(call: ApplyCall, early: frozenset[str]) -> ForwardPrefetch | None:
    """The call's forward prefetch, if some block's gather may be issued ahead: blocks that
    another runtime's interception runs ``around`` (a checkpoint) may run again, and gather
    for themselves."""
    blocks = call.blocks()
    units = [(b, call.param_keys(b.slots)) for b in blocks]
    rerun = {
        b.path
        for b in blocks
        if any(i.around is not None for i in call.interceptions.get(b.path, ()))
    }
    prefetch = ForwardPrefetch(call.plan, call.params, units, rerun, early)
    return prefetch if prefetch.active else None
