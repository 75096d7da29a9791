"""Learning-rate schedules: functions of a 0-d int64 step tensor, built from tensor ops only.

A schedule never reads the step's value in Python (no ``.item()``, no ``if`` on it): it
uses ``torch.clamp``/``torch.where``, so a compiled step that calls it sees one graph for
every step and never recompiles. The arithmetic runs in float64 (a float32 step is exact
only up to 2**24) and the result is a 0-d float32 tensor on the step's device.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

__all__ = ["Schedule", "constant", "cosine_decay", "linear_warmup", "warmup_cosine"]

Schedule = Callable[[torch.Tensor], torch.Tensor]
"""A learning-rate schedule: a 0-d int64 step tensor in, a 0-d float32 tensor out."""


def _check_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    return float(value)


def _check_steps(name: str, value: object, *, allow_zero: bool) -> int:
    smallest = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < smallest:
        raise ValueError(
            f"{name} must be an int >= {smallest}, got {name}={value!r}; it counts optimizer steps"
        )
    return int(value)


def _as_float64(step: torch.Tensor | int) -> torch.Tensor:
    return torch.as_tensor(step).to(torch.float64)


def _cosine_fraction(elapsed: torch.Tensor, steps: int) -> torch.Tensor:
    """0.5 * (1 + cos(pi * min(elapsed, steps) / steps)): 1 at 0, falling to 0 at ``steps``."""
    progress = elapsed.clamp(0, steps) / steps
    return 0.5 * (1.0 + torch.cos(math.pi * progress))


def constant(value: float) -> Schedule:
    """The schedule that is ``value`` at every step.

    Args:
        value: the learning rate.

    Returns:
        A ``Schedule``.

    Raises:
        ValueError: ``value`` is not a finite real number.

    Example:
        >>> import torch
        >>> constant(0.1)(torch.tensor(7))
        tensor(0.1000)
    """
    value = _check_real("value", value)

    def schedule(step: torch.Tensor) -> torch.Tensor:
        return torch.full_like(torch.as_tensor(step), value, dtype=torch.float32)

    return schedule


def linear_warmup(peak: float, warmup_steps: int, init_value: float = 0.0) -> Schedule:
    """Rise linearly from ``init_value`` at step 0 to ``peak`` at ``warmup_steps``, then hold.

    ``lr(t) = init_value + (peak - init_value) * min(t, warmup_steps) / warmup_steps``;
    with ``warmup_steps=0`` it is ``peak`` from step 0.

    Args:
        peak: the learning rate reached at ``warmup_steps`` and held after.
        warmup_steps: length of the ramp, in optimizer steps (>= 0).
        init_value: the learning rate at step 0 (default 0.0).

    Returns:
        A ``Schedule``.

    Raises:
        ValueError: ``warmup_steps`` is negative or not an int, or a value is not finite.

    Example:
        >>> import torch
        >>> linear_warmup(1.0, 4)(torch.tensor(1))
        tensor(0.2500)
    """
    peak = _check_real("peak", peak)
    init_value = _check_real("init_value", init_value)
    warmup_steps = _check_steps("warmup_steps", warmup_steps, allow_zero=True)

    def schedule(step: torch.Tensor) -> torch.Tensor:
        t = _as_float64(step)
        if warmup_steps == 0:
            return torch.full_like(t, peak, dtype=torch.float32)
        fraction = t.clamp(0, warmup_steps) / warmup_steps
        return (init_value + (peak - init_value) * fraction).to(torch.float32)

    return schedule


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Fall from ``init_value`` along a half cosine to ``alpha * init_value``, then hold.

    ``lr(t) = init_value * ((1 - alpha) * 0.5 * (1 + cos(pi * min(t, decay_steps) / decay_steps))
    + alpha)``.

    Args:
        init_value: the learning rate at step 0.
        decay_steps: steps until the floor is reached (>= 1).
        alpha: the floor as a fraction of ``init_value``, in [0, 1] (default 0.0).

    Returns:
        A ``Schedule``.

    Raises:
        ValueError: ``decay_steps`` < 1, ``alpha`` outside [0, 1], or a value is not finite.

    Example:
        >>> import torch
        >>> cosine_decay(1.0, 10)(torch.tensor(5))
        tensor(0.5000)
    """
    init_value = _check_real("init_value", init_value)
    decay_steps = _check_steps("decay_steps", decay_steps, allow_zero=False)
    alpha = _check_real("alpha", alpha)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha is the floor as a fraction of init_value, in [0, 1]; got {alpha=}")

    def schedule(step: torch.Tensor) -> torch.Tensor:
        cosine = _cosine_fraction(_as_float64(step), decay_steps)
        return (init_value * ((1.0 - alpha) * cosine + alpha)).to(torch.float32)

    return schedule


def warmup_cosine(
    peak: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    init_value: float = 0.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak``, then a half cosine down to ``end_value``.

    ``decay_steps`` is the step at which ``end_value`` is reached, counting the warmup (the
    usual "total steps" of a run): the cosine spans ``decay_steps - warmup_steps`` steps, and
    the schedule holds ``end_value`` after it.

    Args:
        peak: the learning rate at ``warmup_steps``.
        warmup_steps: length of the linear ramp, in optimizer steps (>= 0).
        decay_steps: the step where the cosine reaches ``end_value`` (> ``warmup_steps``).
        end_value: the final learning rate (default 0.0).
        init_value: the learning rate at step 0 (default 0.0).

    Returns:
        A ``Schedule``.

    Raises:
        ValueError: a step count is negative or not an int, ``decay_steps <= warmup_steps``,
            or a value is not finite.

    Example:
        >>> import torch
        >>> lr = warmup_cosine(1.0, 2, 6)
        >>> [round(float(lr(torch.tensor(t))), 3) for t in (0, 1, 2, 4, 6, 9)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    peak = _check_real("peak", peak)
    end_value = _check_real("end_value", end_value)
    warmup = linear_warmup(peak, warmup_steps, init_value)
    warmup_steps = int(warmup_steps)
    decay_steps = _check_steps("decay_steps", decay_steps, allow_zero=False)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"decay_steps counts the warmup and must exceed it, got {decay_steps=} and "
            f"{warmup_steps=}; pass the total number of steps, e.g. decay_steps=warmup_steps + N"
        )
    cosine_steps = decay_steps - warmup_steps

    def schedule(step: torch.Tensor) -> torch.Tensor:
        t = _as_float64(step)
        cosine = _cosine_fraction(t - warmup_steps, cosine_steps)
        decayed = (end_value + (peak - end_value) * cosine).to(torch.float32)
        return torch.where(t < warmup_steps, warmup(step), decayed)

    return schedule
