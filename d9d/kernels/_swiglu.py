"""``swiglu``: the public op and its Triton backend as custom ops."""

from __future__ import annotations

import torch
from torch import Tensor

from . import _reference
from ._checks import check_floating, check_same, check_shape
from ._registry import define_op, register_backend, resolve
from ._triton_env import TRITON_DTYPES, triton_auto, triton_unavailable

__all__ = ["swiglu"]


@torch.library.custom_op("d9d::swiglu_triton", mutates_args=())
def _forward(gate: Tensor, up: Tensor) -> Tensor:
    from ._triton import swiglu as kernels

    return kernels.forward(gate, up)


@_forward.register_fake
def _(gate: Tensor, up: Tensor) -> Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("d9d::swiglu_triton_backward", mutates_args=())
def _backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    from ._triton import swiglu as kernels

    return kernels.backward(grad, gate, up)


@_backward.register_fake
def _(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    contiguous = torch.contiguous_format
    return torch.empty_like(gate, memory_format=contiguous), torch.empty_like(
        up, memory_format=contiguous
    )


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _autograd_backward(ctx, grad: Tensor):
    gate, up = ctx.saved_tensors
    return _backward(grad, gate, up)


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def swiglu(gate: Tensor, up: Tensor, *, backend: str | None = None) -> Tensor:
    """The SwiGLU gate of a Llama MLP: ``silu(gate) * up``, elementwise.

    Computed in float32 and cast to ``gate.dtype``. Differentiable in both inputs.

    Args:
        gate: float tensor of any shape (the ``w1``/``gate_proj`` output).
        up: tensor of ``gate``'s shape, dtype and device (the ``w3``/``up_proj`` output).
        backend: ``"reference"``, ``"triton"``, ``"auto"`` or None (see ``d9d.kernels.use``).

    Returns:
        A tensor of ``gate``'s shape and dtype.

    Raises:
        KernelInputError: non-float tensors, or ``up`` unlike ``gate``.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d.kernels as K
        >>> K.swiglu(torch.tensor([0.0, 1.0]), torch.tensor([5.0, 2.0]))
        tensor([0.0000, 1.4621])
    """
    check_floating("swiglu", gate=gate, up=up)
    check_same("swiglu", "dtype", gate=gate, up=up)
    check_same("swiglu", "device", gate=gate, up=up)
    check_shape("swiglu", "up", up, tuple(gate.shape))
    return resolve("swiglu", gate, backend)(gate, up)


define_op("swiglu", _reference.swiglu)
register_backend(
    "swiglu",
    "triton",
    _forward,
    dtypes=TRITON_DTYPES,
    unavailable=triton_unavailable,
    auto=triton_auto,
)
