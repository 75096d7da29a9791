"""Scalings of the updates: ``scale``, ``scale_by_learning_rate`` and ``add_decayed_weights``."""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import torch

from d9d import tree
from d9d.optim._checks import check_non_negative
from d9d.optim._masking import Mask, masked
from d9d.optim._schedules import Schedule, constant
from d9d.optim._transform import (
    GradientTransformation,
    by_kind,
    check_params,
    check_state,
    zero_count,
)

__all__ = [
    "AddDecayedWeightsState",
    "ScaleByLearningRateState",
    "ScaleState",
    "add_decayed_weights",
    "scale",
    "scale_by_learning_rate",
]


class ScaleState(NamedTuple):
    """State of ``scale``: empty."""


class ScaleByLearningRateState(NamedTuple):
    """State of ``scale_by_learning_rate``."""

    # 0-d int64 tensor: the number of updates done so far (the schedule's step).
    count: torch.Tensor
    # 0-d float32 tensor: the rate the last update applied (at init, the one the first will).
    learning_rate: torch.Tensor


class AddDecayedWeightsState(NamedTuple):
    """State of ``add_decayed_weights``: empty."""


def _scaled(leaves: list, factor: float | torch.Tensor) -> list:
    (out,) = by_kind(lambda xs: (torch._foreach_mul(xs, factor),), leaves, outputs=1)
    return out


def scale(step_size: float) -> GradientTransformation:
    """Multiply every update by the constant ``step_size``.

    Args:
        step_size: the factor (negative to descend).

    Returns:
        A ``GradientTransformation`` with state ``ScaleState()``.

    Raises:
        ValueError: ``step_size`` is not a finite real number.

    Example:
        >>> import torch
        >>> s = scale(-2.0)
        >>> s.update({"w": torch.ones(2)}, s.init({"w": torch.ones(2)}))[0]["w"]
        tensor([-2., -2.])
    """
    if (
        isinstance(step_size, bool)
        or not isinstance(step_size, numbers.Real)
        or not math.isfinite(step_size)
    ):
        raise ValueError(f"step_size must be a finite real number, got {step_size=}")

    def init(params: Any) -> ScaleState:
        del params
        return ScaleState()

    def update(updates: Any, state: ScaleState, params: Any = None) -> tuple[Any, Any]:
        check_state(state, ScaleState, "scale")
        del params
        return tree.with_leaves(updates, _scaled(tree.leaves(updates), step_size)), state

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: float | Schedule) -> GradientTransformation:
    """Multiply every update by ``-learning_rate``, a float or a schedule of the step count.

    The schedule is called with the 0-d int64 ``count`` (0 at the first update) and its
    result kept in the state, so ``get_state(state, "learning_rate")`` reads the rate the
    last update applied.

    Args:
        learning_rate: a float >= 0, or a ``Schedule`` such as ``warmup_cosine(3e-4, 100, 10_000)``.

    Returns:
        A ``GradientTransformation`` with state ``ScaleByLearningRateState(count, learning_rate)``.

    Raises:
        ValueError: a float ``learning_rate`` is negative or not finite.
        TypeError: ``learning_rate`` is neither a real number nor callable, or (at ``init``)
            the schedule does not return a 0-d tensor or a params leaf is not a floating or
            complex tensor.

    Example:
        >>> import torch
        >>> sgd = scale_by_learning_rate(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> sgd.update({"w": torch.ones(2)}, sgd.init(params))[0]["w"]
        tensor([-0.1000, -0.1000])
    """
    if isinstance(learning_rate, numbers.Real) and not isinstance(learning_rate, bool):
        check_non_negative("learning_rate", learning_rate)
        schedule = constant(float(learning_rate))
    elif callable(learning_rate):
        schedule = learning_rate
    else:
        raise TypeError(
            f"learning_rate must be a float or a schedule (a callable of the step tensor), "
            f"got {learning_rate=}"
        )

    def init(params: Any) -> ScaleByLearningRateState:
        check_params(params, "scale_by_learning_rate")
        count = zero_count(params)
        learning_rate = schedule(count)
        if not (isinstance(learning_rate, torch.Tensor) and learning_rate.shape == ()):
            raise TypeError(
                f"a learning-rate schedule must return a 0-d tensor, got {learning_rate!r} "
                "at step 0; compute it with tensor ops on the step (see d9d.optim.warmup_cosine)"
            )
        return ScaleByLearningRateState(count=count, learning_rate=learning_rate)

    def update(
        updates: Any, state: ScaleByLearningRateState, params: Any = None
    ) -> tuple[Any, Any]:
        check_state(state, ScaleByLearningRateState, "scale_by_learning_rate")
        del params
        lr = schedule(state.count)
        new_state = ScaleByLearningRateState(count=state.count + 1, learning_rate=lr)
        return tree.with_leaves(updates, _scaled(tree.leaves(updates), -lr)), new_state

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float, mask: Mask | None = None) -> GradientTransformation:
    """Add ``weight_decay * param`` to each update (decoupled decay when chained after Adam).

    Placed before ``scale_by_learning_rate`` the decay is scaled by the learning rate, as in
    ``torch.optim.AdamW``; placed before a momentum it is an L2 penalty, as in
    ``torch.optim.SGD(weight_decay=...)``. With ``weight_decay=0`` the updates pass unchanged.

    Args:
        weight_decay: the coefficient, >= 0.
        mask: restrict the decay to some params, as ``masked`` takes it (a path regex, a list
            of them, a ``(path, param) -> bool`` callable, or a pytree of bools); ``None``
            decays every param.

    Returns:
        A ``GradientTransformation`` with state ``AddDecayedWeightsState()``, or
        ``MaskedState(AddDecayedWeightsState())`` when ``mask`` is given. Its ``update``
        needs ``params``.

    Raises:
        ValueError: ``weight_decay`` is negative, or ``update`` is called without params.

    Example:
        >>> import torch
        >>> decay = add_decayed_weights(0.1)
        >>> params = {"w": torch.full((2,), 2.0)}
        >>> decay.update({"w": torch.zeros(2)}, decay.init(params), params)[0]["w"]
        tensor([0.2000, 0.2000])
    """
    check_non_negative("weight_decay", weight_decay)

    def init(params: Any) -> AddDecayedWeightsState:
        del params
        return AddDecayedWeightsState()

    def update(updates: Any, state: AddDecayedWeightsState, params: Any = None) -> tuple[Any, Any]:
        check_state(state, AddDecayedWeightsState, "add_decayed_weights")
        if params is None:
            raise ValueError(
                "add_decayed_weights needs the params: call update(updates, state, params)"
            )
        if weight_decay == 0:
            return updates, state
        (decayed,) = by_kind(
            lambda us, ps: (torch._foreach_add(us, ps, alpha=weight_decay),),
            tree.leaves(updates),
            tree.leaves(params),
            outputs=1,
        )
        return tree.with_leaves(updates, decayed), state

    transform = GradientTransformation(init, update)
    return transform if mask is None else masked(transform, mask)
