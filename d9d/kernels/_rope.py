"""``rope``: the public op and its Triton backend as custom ops."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import KernelInputError
from . import _reference
from ._checks import check_floating, check_same
from ._registry import define_op, register_backend, resolve
from ._triton_env import TRITON_DTYPES, triton_auto, triton_unavailable

__all__ = ["rope"]


@torch.library.custom_op("d9d::rope_triton", mutates_args=())
def _rotate(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool
) -> tuple[Tensor, Tensor]:
    from ._triton import rope as kernels

    return kernels.rotate(q, k, cos, sin, backward)


@_rotate.register_fake
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> tuple[Tensor, Tensor]:
    contiguous = torch.contiguous_format
    return torch.empty_like(q, memory_format=contiguous), torch.empty_like(
        k, memory_format=contiguous
    )


def _setup_context(ctx, inputs, output) -> None:
    _, _, cos, sin, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward = backward


def _autograd_backward(ctx, dq: Tensor, dk: Tensor):
    cos, sin = ctx.saved_tensors
    dq, dk = _rotate(dq, dk, cos, sin, not ctx.backward)
    return dq, dk, None, None, None


_rotate.register_autograd(_autograd_backward, setup_context=_setup_context)


def _triton_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return _rotate(q, k, cos.detach(), sin.detach(), False)


def _check(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    check_floating("rope", q=q, k=k, cos=cos, sin=sin)
    check_same("rope", "dtype", q=q, k=k)
    check_same("rope", "device", q=q, k=k, cos=cos, sin=sin)
    if q.dim() != 4 or k.dim() != 4:
        raise KernelInputError(
            f"rope: q and k must be [batch, seq, heads, head_dim], got {q.shape=}, {k.shape=}"
        )
    batch, seq, _, head_dim = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (batch, seq, head_dim):
        raise KernelInputError(
            f"rope: k must match q in batch, seq and head_dim, got {q.shape=}, {k.shape=}"
        )
    if head_dim % 2:
        raise KernelInputError(f"rope: head_dim must be even, got {q.shape=}")
    allowed = [(seq, head_dim), (1, seq, head_dim), (batch, seq, head_dim)]
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) not in allowed:
            raise KernelInputError(
                f"rope: {name}.shape={tuple(table.shape)}, expected one of {allowed} for {q.shape=}"
            )


def rope(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, backend: str | None = None
) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of q and k (rotate-half convention, as Hugging Face Llama).

    With ``x = [x1, x2]`` split in halves along ``head_dim``, returns
    ``x * cos + [-x2, x1] * sin`` for ``x`` in (q, k), computed in float32 and cast to
    ``q.dtype``. Layout is **[batch, seq, heads, head_dim]** (the layout a projection's output
    has before any transpose; Hugging Face transposes to ``[batch, heads, seq, head_dim]``
    first). ``cos``/``sin`` are Hugging Face's ``LlamaRotaryEmbedding`` outputs (each angle
    repeated in both halves). Differentiable in q and k; cos and sin get no gradient.

    Args:
        q: ``[B, S, Hq, D]`` float tensor, ``D`` even.
        k: ``[B, S, Hk, D]`` tensor of ``q``'s dtype (``Hk`` may differ: grouped-query).
        cos: ``[S, D]``, ``[1, S, D]`` or ``[B, S, D]`` float tensor.
        sin: like ``cos``.
        backend: ``"reference"``, ``"triton"``, ``"auto"`` or None (see ``d9d.kernels.use``).

    Returns:
        ``(q_rotated, k_rotated)`` of q's and k's shapes and dtype.

    Raises:
        KernelInputError: wrong dims, odd ``head_dim``, mismatched dtypes/devices/shapes.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d.kernels as K
        >>> q = k = torch.tensor([1.0, 0.0]).reshape(1, 1, 1, 2)
        >>> angle = torch.full((1, 2), torch.pi / 2)
        >>> K.rope(q, k, angle.cos(), angle.sin())[0].flatten()
        tensor([-4.3711e-08,  1.0000e+00])
    """
    _check(q, k, cos, sin)
    return resolve("rope", q, backend)(q, k, cos, sin)


define_op("rope", _reference.rope)
register_backend(
    "rope",
    "triton",
    _triton_rope,
    dtypes=TRITON_DTYPES,
    unavailable=triton_unavailable,
    auto=triton_auto,
)
