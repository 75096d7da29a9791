"""``diloco``: replica groups that train apart for H steps, then meet in an outer round.

Why a step wrapper and not a transform or an optimizer: DiLoCo keeps state beside the inner
optimizer's (the params at the last round, the outer optimizer's momentum) and replaces the
params at each round. A transform's runtime sees neither the optimizer state nor the returned
params as a whole, and an optimizer (``d9d.optim``) returns updates, so a group would end a
round at ``params + (anchor - params)``, which rounds differently on each group: the groups
would no longer hold bitwise equal params. Wrapping the step, DiLoCo threads its state through
the optimizer state (:class:`DiLoCoState`, saved by ``d9d.checkpoint`` like any other) and
hands every group the same tensor values. It wraps every transform, as ``d9d.jit`` does, and
composes with any layout inside the group: the pseudo-gradients are all-reduced per local
shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core._step import OutermostStep, TransformedStep
from ...errors import ConfigError, PlanError
from ...optim import GradientTransformation, sgd
from .._replica_groups import async_quorum_refusal
from ._step import DiLoCoStep

__all__ = ["DiLoCo", "diloco"]

MANAGER_METHODS = (
    "start_quorum",
    "allreduce",
    "should_commit",
    "num_participants",
    "register_state_dict_fn",
    "current_step",
    "state_dict",
    "load_state_dict",
)
"""The ``torchft.Manager`` methods ``diloco`` calls: an outer round's, and those of a
rejoin (its state registered when the step is placed, its count of rounds -1 until the
group's first inner step)."""

WEIGHTINGS = ("tokens", "equal")
"""How an outer round weighs each live group's pseudo-gradient."""


@dataclass(frozen=True)
class DiLoCo:
    """The ``diloco`` wrapper; build it with :func:`diloco`, apply it to a step."""

    manager: Any
    inner_steps: int
    outer: GradientTransformation
    weighting: str = "tokens"
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        missing = [m for m in MANAGER_METHODS if not callable(getattr(self.manager, m, None))]
        if missing:
            raise ConfigError(
                f"diloco needs a torchft.Manager, got {type(self.manager).__name__} without "
                f"{missing}; build one with torchft.Manager(pg=ProcessGroupGloo(), ...) "
                "(pip install 'd9d[ft]')"
            )
        refusal = async_quorum_refusal(self.manager, "diloco")
        if refusal is not None:
            raise ConfigError(refusal)
        if (
            isinstance(self.inner_steps, bool)
            or not isinstance(self.inner_steps, int)
            or self.inner_steps < 1
        ):
            raise ConfigError(
                f"diloco(inner_steps={self.inner_steps!r}) must be an int >= 1: the number of "
                "inner steps between outer rounds (the DiLoCo paper uses 500)"
            )
        if not isinstance(self.outer, GradientTransformation):
            raise ConfigError(
                f"diloco(outer={self.outer!r}) must be a d9d.optim GradientTransformation, "
                "such as d9d.optim.sgd(0.7, momentum=0.9, nesterov=True)"
            )
        warmup = self.warmup_steps
        if (
            isinstance(warmup, bool)
            or not isinstance(warmup, int)
            or warmup < 0
            or warmup % self.inner_steps
        ):
            raise ConfigError(
                f"diloco(warmup_steps={warmup!r}) must be an int >= 0 and a multiple of "
                f"inner_steps={self.inner_steps}: the first inner steps, each followed by a "
                "round that averages the groups' params, before rounds come every inner_steps"
            )
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(
                f"diloco(weighting={self.weighting!r}) must be one of {WEIGHTINGS}: 'tokens' "
                "weighs each group's pseudo-gradient by the valid tokens it trained on in the "
                "round, 'equal' weighs every group alike"
            )

    def __call__(self, step: Any) -> DiLoCoStep:
        if isinstance(step, DiLoCoStep):
            raise PlanError("diloco was applied twice to one step; apply it once")
        if not isinstance(step, TransformedStep | OutermostStep):
            step = TransformedStep(step, ())  # a step of one device, its params placed as given
        if isinstance(step, OutermostStep) and not isinstance(step.step, TransformedStep):
            raise PlanError(
                "diloco wraps d9d.jit of a plain function, whose params nothing places (diloco "
                "places its inner step's): compile a transformed step, such as d9d.jit(d9d."
                "shard_params(d9d.make_mesh(fsdp=1), 'fsdp')(step)), or drop d9d.jit"
            )
        return DiLoCoStep(
            step, self.manager, self.inner_steps, self.outer, self.weighting, self.warmup_steps
        )


def diloco(
    manager: Any,
    *,
    inner_steps: int,
    outer: GradientTransformation | None = None,
    weighting: str = "tokens",
    warmup_steps: int = 0,
) -> DiLoCo:
    """Run a step as DiLoCo's inner step: replica groups meet every ``inner_steps`` steps.

    Each replica group (a ``torchrun`` job of its own, any layout inside) runs the wrapped
    step on its own batches with its own (inner) optimizer, without talking to the other
    groups. After every ``inner_steps`` calls comes an outer round: the manager's quorum
    starts; each rank all-reduces its pseudo-gradient ``anchor - params`` (``anchor``: the
    params at the last round) with the same rank of every live group, one collective per
    dtype and 25 MiB bucket; if ``manager.should_commit()``, the outer optimizer steps the
    anchor with their average, and every group goes on from the new anchor (bitwise equal on
    all of them). A round that does not commit (a group failed during it) leaves the anchor
    and the outer state as they were, and the group goes on from the last synced params; the
    inner optimizer's state is kept, as torchft's ``DiLoCo`` does.

    The average weighs each live group by the valid tokens it trained on in the round
    (``weighting="tokens"``, the default): the counts its inner steps' losses recorded
    through :func:`d9d.losses.token_mean` (labels not ignored, over all the group's data
    ranks), summed over its H steps and divided by the live groups' total, all-reduced with
    the pseudo-gradients. So with ``inner_steps=1``, an outer ``sgd(1.0)`` and a plain inner
    SGD, DiLoCo is synchronous data parallelism however unevenly labels are ignored (with
    inner momentum too, while each group's share of the tokens stays the same from step to
    step). An inner step whose loss counts no tokens is refused by name under it.
    ``weighting="equal"`` weighs every group alike, as the DiLoCo paper (whose workers see
    equal batches) and torchft do.

    Warm-up (``warmup_steps=W``): the first W inner steps are each followed by a round whose
    outer step is the plain average (the anchor becomes the groups' weighted mean of params;
    the outer optimizer and its state wait), as post-local SGD starts local SGD (Lin et al.,
    2020) and the DiLoCo paper starts from a pretrained model; rounds then come every H
    steps. Trained from scratch, the outer momentum that hurts in the first rounds helps
    once the groups start from trained params (``docs/fault_tolerance.md``).

    The step's loss is the group's own (inner steps do not communicate); the manager's step
    (``manager.current_step()``) counts committed rounds, -1 from ``place`` until the group's
    first inner step (so that a group restarted before the first round is behind, and healed).

    Rejoin: a restarted group behind the live ones is healed by torchft at the quorum of
    their next round with what a live peer takes into it (params, inner state, anchor, outer
    state, inner step; key ``"d9d.diloco"``, registered at ``place``) and takes part in that
    round with it, weighing 0 (its pseudo-gradient is its peer's: the round averages over
    the groups that trained in it), so that every group goes on from the round's anchor,
    bitwise. A loop calls ``manager.start_quorum()`` before its first step and then
    ``params, state = step.join(params, state)``; one that restores a checkpoint serves it
    first with ``step.serve(params, state)``.

    Args:
        manager: A ``torchft.Manager`` of this rank (``rank``/``world_size`` this rank's in
            its replica group).
        inner_steps: H, the inner steps between outer rounds, >= 1.
        outer: The outer optimizer, applied to the averaged pseudo-gradient as the anchor's
            grad. Default ``d9d.optim.sgd(0.7, momentum=0.9, nesterov=True)``, the DiLoCo
            paper's.
        weighting: ``"tokens"`` (default): each group's pseudo-gradient weighs by the valid
            tokens it trained on in the round; ``"equal"``: every group weighs alike.
        warmup_steps: W, the first inner steps each followed by an averaging round, a
            multiple of ``inner_steps`` (default 0: none).

    Returns:
        The wrapper: apply it to a step (above every transform, and above ``d9d.jit``). The wrapped step's ``place(params, opt_state)`` returns
        ``(params, DiLoCoState)``; call it with that state in place of the optimizer state.

    Raises:
        ConfigError: ``manager`` is not a torchft ``Manager``, ``inner_steps`` is not an
            int >= 1, ``outer`` is not a ``GradientTransformation``, ``weighting`` is
            neither ``"tokens"`` nor ``"equal"``, or ``warmup_steps`` is not an int >= 0
            and a multiple of ``inner_steps``.
        PlanError: the step is already under ``diloco``, or (when placed) votes on each
            step's commit (``d9d.fault_tolerant``) or its optimizer state holds
            ``d9d.optim.master_weights``' masters (a round would be undone by them), or
            (when called, under
            ``weighting="tokens"``) its loss counted no tokens.

    Example:
        >>> import d9d
        >>> d9d.diloco(object(), inner_steps=8)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        d9d.errors.ConfigError: diloco needs a torchft.Manager, got object without ...
    """
    outer = sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer
    return DiLoCo(manager, inner_steps, outer, weighting, warmup_steps)
