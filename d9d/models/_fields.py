"""Checks of the numeric fields both d9d decoder configs share, with one message each."""

from __future__ import annotations

import math
from typing import Any

from d9d.errors import ConfigError

__all__ = ["check_positive_finite", "check_positive_ints", "check_seed"]


def check_positive_ints(config: Any, names: tuple[str, ...]) -> None:
    """Raise unless each field in ``names`` is an int > 0 (a bool is not one)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(
                f"{type(config).__name__}.{name} must be a positive int, got {name}={value!r}."
            )


def check_positive_finite(config: Any, names: tuple[str, ...]) -> None:
    """Raise unless each field in ``names`` is a finite number > 0: an infinite norm eps
    zeroes every activation, an infinite init std or RoPE base gives NaN, and none fails."""
    for name in names:
        value = getattr(config, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value < math.inf
        ):
            raise ConfigError(
                f"{type(config).__name__}.{name} must be a finite positive number, got "
                f"{name}={value!r}."
            )


def check_seed(config: Any) -> None:
    """Raise unless ``config.seed`` is an int."""
    if not isinstance(config.seed, int) or isinstance(config.seed, bool):
        raise ConfigError(f"{type(config).__name__}.seed must be an int, got seed={config.seed!r}.")
