"""``fault_tolerant``: the step's grads averaged over replica groups through a torchft
``Manager``, its update committed or dropped by the manager's vote.

Why a transform of its own and not ``shard_params(replicate_axis=..., fault_tolerant=...)``:
the replica groups are not an axis of the step's mesh. Each group is a ``torchrun`` job of its
own with its own mesh (any layout inside: fsdp, tp, pp, ...), and the groups reach each other only
through the manager's process group, whose members change from step to step. A mesh axis has
a fixed size and a fixed ``DeviceMesh`` group; this reduction has neither, so it lives outside
the plan: the transform claims no mesh axis and rewrites no param's plan, and its runtime
works on the grads the step's own transforms have already reduced inside the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from torch.distributed.device_mesh import DeviceMesh

from ...core._param_plan import ParamPlan
from ...core._phase import Phase
from ...core._plan import Plan
from ...core._transform import Transform
from ...errors import PlanError
from .._replica_groups import async_quorum_refusal
from ._runtime import MANAGER_METHODS, FaultTolerantRuntime

if TYPE_CHECKING:
    from ...core._model import Model

__all__ = ["FaultTolerant", "fault_tolerant"]


@dataclass(frozen=True)
class FaultTolerant(Transform):
    """The ``fault_tolerant`` transform; build it with :func:`fault_tolerant`."""

    name: ClassVar[str] = "fault_tolerant"
    phase: ClassVar[Phase] = Phase.RECOMPUTATION
    manager: Any
    mesh: DeviceMesh | None = None
    starts_quorum: bool = True
    microbatches: int = 1

    def __post_init__(self) -> None:
        if (
            not isinstance(self.microbatches, int)
            or isinstance(self.microbatches, bool)
            or self.microbatches < 1
        ):
            raise PlanError(
                f"fault_tolerant needs microbatches >= 1, got microbatches={self.microbatches!r}"
            )
        missing = [m for m in MANAGER_METHODS if not callable(getattr(self.manager, m, None))]
        if missing:
            raise PlanError(
                f"fault_tolerant needs a torchft.Manager, got {type(self.manager).__name__} "
                f"without {missing}; build one with torchft.Manager(pg=ProcessGroupGloo(), ...) "
                "(pip install 'd9d[ft]')"
            )
        refusal = async_quorum_refusal(self.manager, "fault_tolerant")
        if refusal is not None:
            raise PlanError(refusal)

    def __str__(self) -> str:
        return "fault_tolerant(manager)"

    def claimed_axes(self) -> tuple[str, ...]:
        return ()

    def rewrite(self, entry: ParamPlan) -> ParamPlan:
        return entry

    def runtime(self, plan: Plan, model: Model | None) -> FaultTolerantRuntime:
        del model
        # Stages over ranks (pipeline): the stage executor drives d9d.value_and_grad, its
        # schedule's backwards and the once-a-step reduction inside the group; the reduction
        # over the groups follows it (``reduce_differentiated``).
        staged = plan.stage_group is not None
        if staged and self.microbatches > 1:
            raise PlanError(
                f"fault_tolerant(microbatches={self.microbatches}) does not run under a "
                "pipeline, whose executor runs the step's microbatches itself: give them to "
                "pipeline(microbatches=...) and drop fault_tolerant's"
            )
        return FaultTolerantRuntime(
            self.manager,
            starts_quorum=self.starts_quorum,
            microbatches=self.microbatches,
            after_driver=staged,
        )


def fault_tolerant(
    manager: Any,
    *,
    mesh: DeviceMesh | None = None,
    starts_quorum: bool = True,
    microbatches: int = 1,
) -> FaultTolerant:
    """Average the step's grads over torchft replica groups, which may fail and leave.

    Each replica group (a ``torchrun`` job of its own, any layout inside) runs the same
    transformed step on its own batches. Per step: the manager's quorum starts when the step
    starts; after the backward, whose grads the step's other transforms reduce inside the
    group, each rank all-reduces its grad shards with the same rank of every live replica
    group through the manager's process group; after the step body, ``manager.should_commit()``
    decides: True keeps the update, False (a replica group failed during the step) returns the
    params and optimizer state the step was called with, its metrics those of the dropped
    step. ``d9d train`` then runs the step again on the same batch; a loop of your own tells a
    dropped step by ``manager.current_step()``, which advances only on a commit.

    The loss stays the token mean over the live replicas' batches: each group's grads and loss
    are weighed by its valid-token count (:func:`d9d.losses.token_mean`), and the weighted
    sums and counts are all-reduced together, one collective per dtype and 25 MiB bucket. A
    loss that counts no tokens gives every live group the same weight.

    Rejoin: a group whose step is behind the quorum's (restarted after a failure, or
    started late) is healed by torchft at that quorum: rank ``r`` of a live peer group
    serves the params and optimizer state its step was called with (its local pieces)
    through the manager's checkpoint transport, and rank ``r`` here runs its step from them
    instead of its own, after checking that the peer's layout is its own (else
    ``PlanError``); its ``manager.current_step()`` jumps to the peer's. The transform
    registers that state with the manager when the step is placed (key
    ``"d9d.fault_tolerant"``): place one step per manager. A loop whose batches follow the
    step count (a data loader's position) starts the quorum itself, before it reads the
    step's batch (``starts_quorum=False``), and registers its own state with
    ``manager.register_state_dict_fn``, as ``d9d train`` does.

    Gradient accumulation: with ``microbatches=k`` the transform runs the group's batch as
    ``k`` equal microbatches and all-reduces over the groups once, after the last one, the
    grads summed over them (each microbatch's grads are reduced inside the group as its
    backward ends, so that all-reduce carries each rank's shard); the loss and grads stay the
    token mean over every live group's whole batch. ``shard_params(microbatches=k)`` under
    this transform is refused (both would drive the backward): give ``k`` here instead.
    The sums over the microbatches and the all-reduce over the groups take each param's
    reduce dtype where it is wider than the param's (``shard_params(reduce_dtype=...)``:
    bf16 params reduced in float32 are rounded to bf16 once, at the end).

    Under ``pipeline`` the stage executor drives the backward; the reduction over the
    groups follows it, once a step: each rank all-reduces its own stages' grads (reduced
    inside the group) with the same rank of every live group, which holds the same stages,
    in float32 at least; the executor hands them over in their reduce dtype where it is wider
    than the param's, and each grad is rounded to its dtype once, at the end.
    Its microbatches are ``pipeline``'s (``microbatches`` here must be 1).

    Not yet: ``d9d.jit`` is refused by name; ``step.comms`` does not count the manager's
    traffic.

    Args:
        manager: A ``torchft.Manager`` of this rank (its ``pg`` a ``ProcessGroupGloo`` or
            ``ProcessGroupNCCL``, ``rank``/``world_size`` this rank's in its replica group,
            ``use_async_quorum=False``: the quorum, and a rejoin, end before the step runs).
        mesh: The group's mesh, when no other transform of the step gives it.
        starts_quorum: Each call of the step starts the manager's quorum (default). False:
            the caller calls ``manager.start_quorum()`` before each call, and before it
            reads the call's batch, so that a rejoining group reads the batch of the step
            it joins at.
        microbatches: Gradient-accumulation microbatches per step (>= 1; the batch's
            leading dim divisible by it).

    Returns:
        The transform: decorate a step with it.

    Raises:
        PlanError: ``manager`` is not a torchft ``Manager`` (or is one built with
            ``use_async_quorum=True``), or ``microbatches`` is not a positive int; the step
            accumulates microbatches under another transform, or ``microbatches`` > 1 under
            ``pipeline`` (when placed), or is jitted.

    Example:
        >>> import d9d
        >>> d9d.fault_tolerant(object())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        d9d.errors.PlanError: fault_tolerant needs a torchft.Manager, got object without ...
    """
    return FaultTolerant(manager, mesh, starts_quorum, microbatches)
