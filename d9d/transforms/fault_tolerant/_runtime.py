"""``fault_tolerant`` at run time: the quorum, the grads' reduction over the live replica
groups, and the commit vote.

The grads come out of the backward reduced inside the replica group (laid out as the
group's plan keeps them: a shard per rank under fsdp). Each rank all-reduces its local
pieces with the same rank of every other live group, as torchft's ``Manager.allreduce``
pairs them; every live group holds the same layout, so the pieces line up.

Under a runtime that drives the differentiation itself (a pipeline's executor, which runs
the schedule's backwards and reduces each stage's accumulated grads inside the group once), the
reduction over the groups runs after it, once a step (``reduce_differentiated``): each rank
all-reduces the grads of its own stages with the same rank, holding the same stages, of
every live group.

A group whose step is behind the quorum's (restarted after a failure) is healed by torchft
at the quorum: the runtime registers its state dict with the manager, serving the params and
optimizer state the step was called with, and takes a peer's in their place (``_rejoin``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from ...core._gather import local_like
from ...core._microbatches import sum_microbatches
from ...core._runtime import Differentiation, Runtime
from .._rejoin import PeerState
from .._replica_groups import (
    GroupCount,
    all_reduce_over_groups,
    token_mean_over_groups,
    tokens_like,
)

__all__ = ["MANAGER_METHODS", "FaultTolerantRuntime"]

MANAGER_METHODS = (
    "start_quorum",
    "allreduce",
    "should_commit",
    "num_participants",
    "register_state_dict_fn",
    "current_step",
)
"""The ``torchft.Manager`` methods the runtime calls."""

_log = logging.getLogger("d9d.fault_tolerant")

STATE_KEY = "d9d.fault_tolerant"
"""The key of the params and optimizer state in torchft's state dict of a replica group."""


class FaultTolerantRuntime(Runtime):
    """The runtime of ``fault_tolerant`` with ``manager``; with ``after_driver``, another
    runtime drives the differentiation and the grads are reduced over the groups after it."""

    shared = False  # an eval step sharing the plan neither starts a quorum nor votes
    # Summed over microbatches and groups in the plan's reduce dtype where it is wider than
    # the param's (bf16 params, reduce_dtype=float32), rounded once by value_and_grad; a
    # driving pipeline hands its grads over in it (``Differentiation.leaves``).
    widens_grads = True
    tokens_beyond_mesh = "fault_tolerant, whose other replica groups hold tokens of the step"

    def __init__(
        self,
        manager: Any,
        *,
        starts_quorum: bool = True,
        microbatches: int = 1,
        after_driver: bool = False,
    ) -> None:
        self.manager = manager
        self.starts_quorum = starts_quorum
        self.microbatches = microbatches
        self.drives_differentiation = not after_driver
        self.groups = GroupCount(_log, "fault_tolerant", "steps")
        self.peer = PeerState(
            manager, STATE_KEY, "fault_tolerant", "runtime.serve(params, opt_state)"
        )

    def jit_refusal(self) -> str | None:
        return (
            "fault_tolerant runs eagerly: its quorum, reduction over replica groups and "
            "commit vote are host calls into the torchft Manager; drop d9d.jit"
        )

    def comms_refusal(self) -> str | None:
        return (
            "step.comms runs a step, and under fault_tolerant that step would be committed "
            "with the live replica groups, and the manager's collectives are not counted; "
            "count the step without d9d.fault_tolerant"
        )

    def start_step(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        self.peer.serve(params, opt_state)
        if self.starts_quorum:
            self.manager.start_quorum()
        taken = self.peer.take(params, opt_state)
        if taken is not None:
            params, opt_state, _ = taken
            _log.warning(
                "fault_tolerant: this replica group rejoined at step %d with a live peer's "
                "params and optimizer state",
                self.manager.current_step(),
            )
        return params, opt_state

    def end_step(self, params: Any, opt_state: Any) -> None:
        # What the next step will be called with: served to a peer that rejoins at its
        # quorum, which a caller may start before the call (``starts_quorum=False``).
        self.serve(params, opt_state)

    def serve(self, params: Any, opt_state: Any) -> None:
        """Serve ``params`` and ``opt_state`` to a group that rejoins before the next step:
        those the next step will be called with, when the caller replaced what the last step
        returned (a restored checkpoint, before any step ran)."""
        self.peer.serve(params, opt_state)

    def differentiate(
        self, job: Differentiation
    ) -> tuple[torch.Tensor, Any, list[Any], torch.Tensor | None]:
        value, aux, grads, weight = self._run(job)
        value, grads, count = self._over_groups(value, grads, weight)
        return value, aux, grads, count

    def reduce_differentiated(
        self, value: torch.Tensor, grads: list[Any], weight: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[Any]]:
        if self.drives_differentiation:  # reduced in ``differentiate``
            return value, grads
        # In float32 at least, each grad back in its dtype after: the driver's grads are means
        # (in their accumulated dtype: ``widens_grads``), which a bf16 product with the count
        # and quotient would round. value_and_grad rounds them to the params' dtypes once.
        wide = [_times(g, weight) if weight is not None else _wide(g) for g in grads]
        value, wide, _ = self._over_groups(value, wide, weight)
        return value, [w.to(g.dtype) for w, g in zip(wide, grads, strict=True)]

    def _over_groups(
        self, value: torch.Tensor, grads: list[Any], weight: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[Any], torch.Tensor | None]:
        """``(value, grads, count)`` over the live groups, from the group's mean ``value``
        and its ``grads``: sums over its ``weight`` valid tokens, or means when ``weight``
        is None (every live group then weighs the same). ``count``: the live groups'
        valid tokens."""
        pieces = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        count = None
        if weight is None:
            # No token count: every live group weighs the same (the manager divides the sums
            # by the number of participants).
            *means, value = all_reduce_over_groups(
                self.manager, [*pieces, value.reshape(1)], ReduceOp.AVG
            )
            value = value.reshape(())
        else:
            count = tokens_like(weight, value)
            value_sum = (value.to(count.dtype) * count).reshape(1)
            (mean, *means), count = token_mean_over_groups(
                self.manager, [value_sum, *pieces], weight
            )
            value = mean.reshape(()).to(value.dtype)
        out = [
            local_like(m, g) if isinstance(g, DTensor) else m
            for m, g in zip(means, grads, strict=True)
        ]
        self.groups.update(self.manager)
        return value, out, count

    def _run(self, job: Differentiation) -> tuple[torch.Tensor, Any, list[Any], Any]:
        """``(value, aux, grads, weight)`` of the group's batch: the value a token mean over
        it, the grads those of ``weight * value`` (a sum over its valid tokens); without a
        token count, the mean value and grads. Over microbatches, each one's grads are
        reduced inside the group as its backward ends (not deferred: the all-reduce over the
        groups then carries each rank's shard once per step, not its unreduced grads)."""
        if self.microbatches == 1:
            return job.run(job.args, job.kwargs, True)
        total, aux, grads, weight = sum_microbatches(job, self.microbatches, defer_reduction=False)
        if weight is None:
            k = self.microbatches
            return total / k, aux, [g / k for g in grads], None
        return total / weight.clamp(min=1), aux, grads, weight

    def commit(self) -> bool:
        kept = bool(self.manager.should_commit())
        if not kept:
            _log.warning("fault_tolerant: a replica group failed during the step; update dropped")
        return kept


def _times(grad: Any, weight: torch.Tensor) -> Any:
    """``grad`` (a DTensor's local piece in its stead) times ``weight``, in float32 at
    least: a bfloat16 weight would round token counts above 256."""
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    count = tokens_like(weight, local)
    scaled = local.to(count.dtype) * count
    return local_like(scaled, grad) if isinstance(grad, DTensor) else scaled


def _wide(grad: Any) -> Any:
    """``grad`` (a DTensor's local piece in its stead) in float32 at least."""
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    wide = local.to(torch.promote_types(local.dtype, torch.float32))
    return local_like(wide, grad) if isinstance(grad, DTensor) else wide
