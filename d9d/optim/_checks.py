"""Eager checks of optimizer hyperparameters; each error names the value and what is allowed."""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "check_bool",
    "check_non_negative",
    "check_positive",
    "check_state_dtype",
    "check_unit_interval",
]


def _is_real(value: object) -> bool:
    # numbers.Real, not int | float: a numpy float32 (a config read with numpy) is a real
    # number too, and was refused as "must be a finite real number" (numpy float64, a
    # float subclass, passed).
    return (
        isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)  # type: ignore[arg-type]
    )


def check_bool(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a bool (a switch, not a number: torch's
    ``SGD(params, lr, momentum, dampening, ...)`` passed positionally puts a dampening there)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} is a switch and must be True or False, got {name}={value!r}")


def check_unit_interval(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``0 <= value < 1`` (a decay rate)."""
    if not (_is_real(value) and 0.0 <= value < 1.0):  # type: ignore[operator]
        raise ValueError(f"{name} is a decay rate and must be in [0, 1), got {name}={value!r}")


def check_non_negative(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite real number >= 0."""
    if not (_is_real(value) and value >= 0.0):  # type: ignore[operator]
        raise ValueError(f"{name} must be a finite real number >= 0, got {name}={value!r}")


def check_positive(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite real number > 0."""
    if not (_is_real(value) and value > 0.0):  # type: ignore[operator]
        raise ValueError(f"{name} must be a finite real number > 0, got {name}={value!r}")


def check_state_dtype(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is None or a floating dtype of 2 bytes or more."""
    if value is None or (
        isinstance(value, torch.dtype) and value.is_floating_point and value.itemsize >= 2
    ):
        return
    raise ValueError(
        f"{name} is the dtype an optimizer state is stored in and must be None (the param's "
        f"dtype) or a floating dtype of 2 bytes or more (torch.bfloat16, torch.float16, "
        f"torch.float32, torch.float64), got {name}={value!r}; 8-bit state needs per-block "
        "scales, which d9d.optim does not build yet"
    )
