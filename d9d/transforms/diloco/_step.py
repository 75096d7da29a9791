"""``DiLoCoStep``: a step run as DiLoCo's inner step, with an outer round every H calls (every call
of a warm-up)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

from ... import tree
from ...core._context import StepContext, watching_steps
from ...core._memory import Memory, local_bytes
from ...core._runtime import Runtime
from ...core._step import OutermostStep
from ...errors import PlanError
from ...optim import GradientTransformation, MasterWeightsState, sgd
from .._rejoin import PeerState
from .._replica_groups import GroupCount
from ._outer_round import outer_round
from ._state import DiLoCoState

__all__ = ["DiLoCoStep"]

_log = logging.getLogger("d9d.diloco")


class DiLoCoStep(OutermostStep):
    """A step under :func:`d9d.diloco`; call it like the step it wraps, with a
    :class:`DiLoCoState` (from ``place``) in place of the optimizer state.

    Attributes other than its own (``plan``, ``mesh``) are read from the wrapped step.
    """

    def __init__(
        self,
        step: Any,
        manager: Any,
        inner_steps: int,
        outer: GradientTransformation,
        weighting: str,
        warmup_steps: int = 0,
    ) -> None:
        self.step = step
        self.manager = manager
        self.inner_steps = inner_steps
        self.outer = outer
        self.weighting = weighting
        self.warmup_steps = warmup_steps
        self.groups = GroupCount(_log, "diloco", "outer rounds")
        self.peer: PeerState | None = None  # built at place: one step per manager
        functools.update_wrapper(self, step, updated=())

    def refusal_of(self, name: str) -> str:
        if name == "jit":
            return (
                "jit was applied to a step under d9d.diloco, whose outer round is host calls "
                "into the torchft Manager; compile the inner step instead: "
                "d9d.diloco(manager, inner_steps=H)(d9d.jit(step))"
            )
        return (
            f"{name} was applied to a step already under d9d.diloco; diloco must wrap every "
            f"transform: put @d9d.diloco(...) above the @d9d.{name}(...) decorator"
        )

    def __getattr__(self, name: str) -> Any:
        step = self.__dict__.get("step")
        if step is None:
            raise AttributeError(name)
        return getattr(step, name)

    def place(self, params: Any, opt_state: Any, **kwargs: Any) -> tuple[Any, DiLoCoState]:
        """The wrapped step's ``place``, and the outer state beside its optimizer state.

        A manager at step 0 is set to -1 committed rounds until the first inner step (or a
        heal): behind groups that train, so that a group restarted before their first
        committed round is healed at it (``docs/fault_tolerance.md``).

        Returns:
            ``(params, DiLoCoState(inner=opt_state, anchor=a copy of params, outer=
            outer.init(params), inner_step=0, tokens=0))``, every tree laid out like the
            placed params.
        """
        if _holds_masters(opt_state):
            raise PlanError(
                "diloco does not run with an inner optimizer that keeps master copies of the "
                "params (d9d.optim.master_weights) yet: an outer round replaces the params "
                "with the new anchor, but the inner optimizer would go on from its masters, "
                "the group's own params before the round, and undo it; store the params in "
                "float32 (shard_params(param_dtype=torch.bfloat16) computes in bfloat16), or "
                "drop master_weights"
            )
        params, opt_state = self.step.place(params, opt_state, **kwargs)
        voting = [type(r).__name__ for r in self.step.runtimes if _votes(r)]
        if voting:
            raise PlanError(
                f"diloco wraps a step whose runtimes {voting} vote on every step's commit "
                "(d9d.fault_tolerant): the replica groups would exchange grads every step "
                "and params every round; drop d9d.fault_tolerant from the inner step, diloco's "
                "outer round is the only exchange between replica groups"
            )
        # torchft heals a group behind the live ones (restarted) at a quorum with their state:
        # params, inner state, anchor, outer state, inner step and the round's tokens.
        self.peer = PeerState(self.manager, STATE_KEY, "diloco", "step.serve(params, state)")
        anchor = tree.map(torch.clone, params)
        inner_step, tokens = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        state = DiLoCoState(opt_state, anchor, self.outer.init(anchor), inner_step, tokens)
        self.serve(params, state)
        if self.manager.current_step() == 0:
            _count_rounds(self.manager, NOT_STARTED)
        return params, state

    def __call__(self, params: Any, state: DiLoCoState, batch: Any) -> tuple[Any, Any, Any]:
        if not isinstance(state, DiLoCoState):
            raise TypeError(
                f"a diloco step takes a DiLoCoState as its optimizer state, got "
                f"{type(state).__name__}; build it with step.place(params, opt.init(params))"
            )
        if self.manager.current_step() == NOT_STARTED:
            _count_rounds(self.manager, 0)  # this group trains: at round 0 with the others
        with watching_steps() as ran:
            params, inner, metrics = self.step(params, state.inner, batch)
        tokens = state.tokens + self._counted(ran) if self.weighting == "tokens" else state.tokens
        state = DiLoCoState(inner, state.anchor, state.outer, state.inner_step + 1, tokens)
        done = int(state.inner_step)
        if done <= self.warmup_steps or done % self.inner_steps == 0:
            # A group healing at this round's quorum takes what this one all-reduces.
            self._serving().serve(params, state, in_round=True)
            self.manager.start_quorum()
            params, state = self._met(params, state, in_round=True)
        self._serving().serve(params, state, in_round=False)
        return params, state, metrics

    def join(self, params: Any, state: DiLoCoState) -> tuple[Any, DiLoCoState]:
        """After a quorum the caller started before the first step (``manager.start_quorum()``):
        if this group healed at it, the live peer's params and state, and, when the peer was
        inside an outer round, that round run to its end with them; else ``params`` and
        ``state`` as given.

        A group restarted behind the live ones waits there for their next outer round, and
        takes part in it with the state its peer all-reduces, so that every group goes on
        from the round's anchor, bitwise equal (``docs/fault_tolerance.md``).
        """
        params, state = self._met(params, state, in_round=False)
        self._serving().serve(params, state, in_round=False)
        return params, state

    def serve(self, params: Any, state: DiLoCoState) -> None:
        """Serve ``params`` and ``state`` to a group that heals from this one before the next
        step: those the next step will be called with, when the caller replaced what the
        last step returned (a restored checkpoint)."""
        self._serving().serve(params, state, in_round=False)

    def _serving(self) -> PeerState:
        if self.peer is None:
            raise PlanError("a diloco step runs after step.place(params, opt_state); place it")
        return self.peer

    def _met(self, params: Any, state: DiLoCoState, in_round: bool) -> tuple[Any, DiLoCoState]:
        """After a quorum: a peer's state if this group healed at it, and the round when one
        follows (the peer's, or this group's own)."""
        taken = self._serving().take(params, state)
        healed = taken is not None
        if healed:
            params, state, flags = taken
            in_round = bool(flags["in_round"])
            _log.warning(
                "diloco: this replica group rejoined after outer round %d, at inner step %d, "
                "with a live peer's params, anchor and optimizer states",
                self.manager.current_step(),
                int(state.inner_step),
            )
        if not in_round:
            return params, state
        if healed:
            # Its params and count are its peer's: counted once, by the peer. The round
            # averages over the groups that trained in it.
            weight = torch.zeros((), dtype=torch.int64)
        elif self.weighting == "tokens":
            weight = state.tokens
        else:
            weight = torch.ones((), dtype=torch.int64)
        if int(state.inner_step) <= self.warmup_steps:  # the plain average; the outer waits
            plain = _AVERAGE.init(state.anchor)
            anchor, _, committed = outer_round(
                self.manager, _AVERAGE, state.anchor, plain, params, weight
            )
            outer_state = state.outer
        else:
            anchor, outer_state, committed = outer_round(
                self.manager, self.outer, state.anchor, state.outer, params, weight
            )
        self._log_round(committed, int(state.inner_step))
        # Copies: a jitted inner step updates its params in place, and the anchor must stay
        # as the round left it. The round's tokens are spent, committed or dropped.
        params = tree.map(torch.clone, anchor)
        zero = torch.zeros((), dtype=torch.int64)
        return params, DiLoCoState(state.inner, anchor, outer_state, state.inner_step, zero)

    def _counted(self, ran: list[StepContext]) -> torch.Tensor:
        """The valid tokens the inner step's losses counted, over the group's data ranks."""
        counts = [context.tokens for context in ran if context.tokens is not None]
        if not counts:
            raise PlanError(
                "diloco(weighting='tokens') weighs each replica group by the valid tokens its "
                "inner steps trained on, but this inner step's loss counted none (no "
                "d9d.losses.token_mean or cross_entropy under d9d.value_and_grad); compute the "
                "loss with them, or weigh every group alike: "
                "d9d.diloco(manager, inner_steps=H, weighting='equal')"
            )
        return torch.stack(counts).sum()

    def memory(self, params: Any, state: DiLoCoState) -> Memory:
        """The wrapped step's ``memory``, its optimizer state counting the anchor, the outer
        state and the step and token counters too (bytes per rank); the rest as the wrapped
        step's (its host state, its grads accumulated over microbatches)."""
        inner = self.step.memory(params, state.inner)
        extra = sum(local_bytes(leaf) for leaf in tree.leaves(state[1:]))
        return dataclasses.replace(inner, opt_state=inner.opt_state + extra)

    def comms(self, params: Any, state: DiLoCoState, batch: Any) -> Any:
        """The collectives of one inner step (inside the replica group; it runs one, with no
        outer round). An outer round adds one all-reduce per dtype and 25 MiB over the replica groups,
        of each rank's local params, every ``inner_steps`` steps."""
        return self.step.comms(params, state.inner, batch)

    def _log_round(self, committed: bool, inner_step: int) -> None:
        if not committed:
            _log.warning(
                "diloco: a replica group failed during the outer round after inner step %d; "
                "round dropped, this group goes on from the last synced params",
                inner_step,
            )
            return
        self.groups.update(self.manager)


_AVERAGE = sgd(1.0)
"""A warm-up round's outer step: the anchor moves by the whole averaged pseudo-gradient."""

STATE_KEY = "d9d.diloco"
"""The key of ``diloco``'s part of torchft's state dict of a replica group."""

NOT_STARTED = -1
"""The committed rounds a placed group counts until its first inner step (or a heal): behind
groups that train, even before their first committed round, so that torchft heals a group
restarted then at their next quorum (it heals a group whose count is behind the quorum's)."""


def _count_rounds(manager: Any, rounds: int) -> None:
    """Set the committed rounds ``manager`` counts (its step), its other counts kept."""
    manager.load_state_dict({**manager.state_dict(), "step": rounds})


def _holds_masters(opt_state: Any) -> bool:
    """Whether ``opt_state`` holds ``master_weights``'s copies of the params, in the
    NamedTuples, tuples and lists that ``chain``, ``masked`` and ``offloaded`` build."""
    if isinstance(opt_state, MasterWeightsState):
        return True
    if isinstance(opt_state, tuple | list):
        return any(_holds_masters(s) for s in opt_state)
    return False


def _votes(runtime: Runtime) -> bool:
    return type(runtime).commit is not Runtime.commit
