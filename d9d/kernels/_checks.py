"""Input validation shared by the public ops: every message names the op, the argument and
the value, and says what is allowed."""

from __future__ import annotations

import torch

from ..errors import KernelInputError

__all__ = ["check_floating", "check_same", "check_shape"]


def check_floating(op: str, **tensors: torch.Tensor) -> None:
    """Raises unless every tensor is a floating-point ``torch.Tensor``."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise KernelInputError(f"{op}: {name} must be a torch.Tensor, got {type(tensor)}")
        if not tensor.is_floating_point():
            raise KernelInputError(
                f"{op}: {name} must be a floating-point tensor, got {name}.dtype={tensor.dtype}"
            )


def check_same(op: str, attribute: str, **tensors: torch.Tensor) -> None:
    """Raises unless all tensors have the same ``attribute`` (``"dtype"`` or ``"device"``)."""
    values = {name: getattr(tensor, attribute) for name, tensor in tensors.items()}
    if len(set(values.values())) > 1:
        listed = ", ".join(f"{name}.{attribute}={value}" for name, value in values.items())
        raise KernelInputError(f"{op}: {listed}; they must have the same {attribute}")


def check_shape(op: str, name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Raises unless ``tensor.shape == expected``."""
    if tuple(tensor.shape) != tuple(expected):
        raise KernelInputError(
            f"{op}: {name}.shape={tuple(tensor.shape)}, expected {tuple(expected)}"
        )
