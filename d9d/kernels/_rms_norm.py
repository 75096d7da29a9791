"""``rms_norm`` and ``fused_add_rms_norm``: public ops and their Triton backend as custom ops."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import KernelInputError
from . import _reference
from ._checks import check_floating, check_same, check_shape
from ._registry import define_op, register_backend, resolve
from ._triton_env import TRITON_DTYPES, triton_auto, triton_unavailable

__all__ = ["fused_add_rms_norm", "rms_norm"]

MAX_HIDDEN = 65536  # the Triton kernel holds one row in registers


@torch.library.custom_op("d9d::rms_norm_triton", mutates_args=())
def _forward(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, rstd, x + residual)``; the last is empty without a residual."""
    from ._triton import rms_norm as kernels

    y, new_residual, rstd = kernels.forward(x, residual, weight, eps)
    return y, rstd, x.new_empty(0) if new_residual is None else new_residual


@_forward.register_fake
def _(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return y, rstd, x.new_empty(0) if residual is None else torch.empty_like(y)


@torch.library.custom_op("d9d::rms_norm_triton_backward", mutates_args=())
def _backward(
    dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, dres: Tensor | None, need_dweight: bool
) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)``: ``dx`` includes ``dres``; ``dweight`` is empty unless needed."""
    from ._triton import rms_norm as kernels

    return kernels.backward(dy, x, weight, rstd, dres, need_dweight)


@_backward.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, dres: Tensor | None, need_dweight: bool):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return dx, torch.empty_like(weight) if need_dweight else weight.new_empty(0)


def _setup_context(ctx, inputs, output) -> None:
    x, residual, weight, _ = inputs
    # With a residual, the norm's input is the new residual (the last output).
    ctx.save_for_backward(x if residual is None else output[2], weight, output[1])
    ctx.has_residual = residual is not None


def _autograd_backward(ctx, dy: Tensor, drstd: Tensor, dres: Tensor):
    normed_input, weight, rstd = ctx.saved_tensors
    need_dweight = ctx.needs_input_grad[2]
    dres = dres if ctx.has_residual else None
    dx, dweight = _backward(dy, normed_input, weight, rstd, dres, need_dweight)
    return dx, dx if ctx.has_residual else None, dweight if need_dweight else None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def _check_triton_hidden(x: Tensor) -> None:
    if x.shape[-1] > MAX_HIDDEN:
        raise KernelInputError(
            f"the triton backend of rms_norm holds a row in registers: hidden size "
            f"{x.shape[-1]} > {MAX_HIDDEN}; use backend='reference'"
        )


def _triton_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    _check_triton_hidden(x)
    return _forward(x, None, weight, eps)[0]


def _triton_fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    _check_triton_hidden(x)
    y, _, new_residual = _forward(x, residual, weight, eps)
    return y, new_residual


def _check(op: str, x: Tensor, weight: Tensor, eps: float) -> None:
    check_floating(op, x=x, weight=weight)
    check_same(op, "device", x=x, weight=weight)
    if x.dim() == 0:
        raise KernelInputError(f"{op}: x must have at least one dim, got {x.shape=}")
    check_shape(op, "weight", weight, (x.shape[-1],))
    if not eps >= 0:
        raise KernelInputError(f"{op}: {eps=} must be >= 0")


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, backend: str | None = None) -> Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x**2, -1) + eps) * weight``.

    Computed in float32 and cast to ``x.dtype`` (``weight`` may have another float dtype,
    e.g. float32 weights with bfloat16 activations). Differentiable in ``x`` and ``weight``.

    Args:
        x: ``[..., hidden]`` float tensor, any leading shape.
        weight: ``[hidden]`` float tensor on ``x``'s device.
        eps: added to the mean square; default 1e-6.
        backend: ``"reference"``, ``"triton"``, ``"auto"`` or None (see ``d9d.kernels.use``).

    Returns:
        A tensor of ``x``'s shape and dtype.

    Raises:
        KernelInputError: non-float tensors, mismatched devices, ``weight`` not ``[hidden]``.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d.kernels as K
        >>> K.rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), eps=0.0)
        tensor([[0.8485, 1.1314]])
    """
    _check("rms_norm", x, weight, eps)
    return resolve("rms_norm", x, backend)(x, weight, eps)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, *, backend: str | None = None
) -> tuple[Tensor, Tensor]:
    """``h = x + residual`` and ``rms_norm(h)`` in one pass: a pre-norm block's entry.

    ``h`` is rounded to ``x.dtype`` before it is normalized, exactly as the unfused code
    ``h = x + residual; rms_norm(h)`` would. Differentiable in all three tensors.

    Args:
        x: ``[..., hidden]`` float tensor (the sublayer output).
        residual: tensor of ``x``'s shape and dtype (the residual stream).
        weight: ``[hidden]`` float tensor.
        eps: added to the mean square; default 1e-6.
        backend: ``"reference"``, ``"triton"``, ``"auto"`` or None.

    Returns:
        ``(normed, new_residual)``, both of ``x``'s shape and dtype.

    Raises:
        KernelInputError: as :func:`rms_norm`, or ``residual`` unlike ``x``.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d.kernels as K
        >>> normed, h = K.fused_add_rms_norm(torch.ones(1, 2), torch.ones(1, 2), torch.ones(2))
        >>> h
        tensor([[2., 2.]])
    """
    _check("fused_add_rms_norm", x, weight, eps)
    check_floating("fused_add_rms_norm", residual=residual)
    check_same("fused_add_rms_norm", "dtype", x=x, residual=residual)
    check_same("fused_add_rms_norm", "device", x=x, residual=residual)
    check_shape("fused_add_rms_norm", "residual", residual, tuple(x.shape))
    return resolve("fused_add_rms_norm", x, backend)(x, residual, weight, eps)


define_op("rms_norm", _reference.rms_norm)
define_op("fused_add_rms_norm", _reference.fused_add_rms_norm)
for _op, _impl in (
    ("rms_norm", _triton_rms_norm),
    ("fused_add_rms_norm", _triton_fused_add_rms_norm),
):
    register_backend(
        _op,
        "triton",
        _impl,
        dtypes=TRITON_DTYPES,
        unavailable=triton_unavailable,
        auto=triton_auto,
    )
