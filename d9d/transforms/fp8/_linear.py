"""A linear layer's three matmuls in fp8: the autograd function ``fp8``'s interception calls.

For ``y = x @ w.T`` (``x [M, K]``, ``w [N, K]``, leading dims of ``x`` flattened into ``M``):

- output ``y = x @ w.T``: ``x`` and ``w`` quantized along ``K`` (e4m3);
- input grad ``dx = dy @ w``: ``dy`` quantized along ``N`` (the grad format), ``w`` along ``N``;
- weight grad ``dw = dy.T @ x``: ``dy.T`` and ``x`` quantized along ``M`` (the tokens).

Each operand is quantized afresh from its high-precision value as its matmul needs (dynamic
scaling: the amax of this call's tensor, no history), through the registry's
``fp8_quantize`` and ``fp8_gemm``. Recipes, per operand:

=========== ====================== ====================== ================================
recipe      activations, weights   grads (``dy``)         scale groups
=========== ====================== ====================== ================================
tensorwise  e4m3                   e5m2                   the whole matrix
rowwise     e4m3                   e5m2                   a row of ``a``, a column of ``b``
blockwise   e4m3                   e4m3 (DeepSeek-V3)     ``a`` 1x128 tiles along the
                                                          contraction, ``b`` 128x128 blocks
=========== ====================== ====================== ================================

The weight grad's ``b`` operand (``x``) is in 128x128 blocks under blockwise, as the GEMM
takes ``b``; DeepSeek-V3 tiles it 1x128 along the tokens. A weight all-gathered in fp8
(``_gather``: tensorwise data and scale) is the output's and the input grad's ``b`` as it
is: tensorwise quantizes ``w`` and ``w.T`` alike. The forward saves ``x`` and ``w`` in
their own dtype (not fp8). The bias is added in high precision; the output has ``x``'s dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...kernels import fp8_gemm, fp8_quantize
from ._weight import Fp8Weight

__all__ = ["E4M3", "GRAD_DTYPES", "MULTIPLE", "fp8_linear"]

E4M3 = torch.float8_e4m3fn
GRAD_DTYPES = {"tensorwise": torch.float8_e5m2, "rowwise": torch.float8_e5m2, "blockwise": E4M3}
# torch._scaled_mm takes K and N in multiples of 16: the weight grad's K is the token count,
# padded with zero rows to one (zeros change no amax, and add nothing to the product).
MULTIPLE = 16


def _as_a(x: Tensor, recipe: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``x [rows, k]`` quantized as a GEMM's ``a``: along ``k``."""
    return fp8_quantize(x, recipe, dtype)


def _as_b(x: Tensor, recipe: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``x [k, cols]`` quantized as a GEMM's ``b``: along ``k`` (128x128 blocks blockwise)."""
    return fp8_quantize(x, recipe, dtype, dim=-2, block=(128, 128))


def _matmul(
    a: Tensor,
    b: tuple[Tensor, Tensor],
    recipe: str,
    a_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> Tensor:
    """``a [M, K] @ b [K, N]`` with ``a`` quantized along ``K`` in ``a_dtype`` and ``b``
    given quantized (``(data, scale)``), in ``out_dtype``."""
    return fp8_gemm(*_as_a(a, recipe, a_dtype), *b, recipe, out_dtype)


def _weight_as_b(
    weight: Tensor, gathered: tuple[Tensor, ...], recipe: str, *, transposed: bool
) -> tuple[Tensor, Tensor]:
    """``weight.T [K, N]`` (the output's ``b``) or ``weight [N, K]`` (the input grad's)
    quantized along its rows; a weight gathered in fp8 (tensorwise: an :class:`Fp8Weight`,
    or under ``d9d.jit`` its data and scale in ``gathered``) is that quantization already,
    its data and scale used as they are."""
    if isinstance(weight, Fp8Weight):
        gathered = (weight.fp8_data, weight.fp8_scale)
    if gathered:
        data, scale = gathered
        return (data.t(), scale.t()) if transposed else (data, scale)
    return _as_b(weight.t() if transposed else weight, recipe, E4M3)


class _Fp8Linear(torch.autograd.Function):
    """``x [M, K] @ w.T`` with its three matmuls in fp8; no bias."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, recipe: str, *gathered: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight, *gathered)
        ctx.recipe = recipe
        b = _weight_as_b(weight, gathered, recipe, transposed=True)
        return _matmul(x, b, recipe, E4M3, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, *gathered = ctx.saved_tensors
        recipe, grad_dtype = ctx.recipe, GRAD_DTYPES[ctx.recipe]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            b = _weight_as_b(weight, tuple(gathered), recipe, transposed=False)
            grad_x = _matmul(grad, b, recipe, grad_dtype, x.dtype)
        if ctx.needs_input_grad[1]:
            pad = -x.shape[0] % MULTIPLE
            grad_t, x_padded = F.pad(grad.t(), (0, pad)), F.pad(x, (0, 0, 0, pad))
            b = _as_b(x_padded, recipe, E4M3)
            grad_w = _matmul(grad_t, b, recipe, grad_dtype, weight.dtype)
        return grad_x, grad_w, None, *([None] * len(gathered))


def fp8_linear(
    x: Tensor, weight: Tensor | tuple[Tensor, Tensor, Tensor], bias: Tensor | None, recipe: str
) -> Tensor:
    """``F.linear(x, weight, bias)`` with the output, input grad and weight grad computed in
    fp8 under ``recipe`` (module doc); the bias added in ``x``'s dtype. ``weight`` may be
    one gathered in fp8: an :class:`Fp8Weight`, or under ``d9d.jit`` the gather codec's
    ``(weight, data, scale)`` (``_gather``).

    Example:
        >>> x, w = torch.randn(4, 32), torch.randn(16, 32)
        >>> fp8_linear(x, w, None, "rowwise").shape
        torch.Size([4, 16])
    """
    *lead, k = x.shape
    weight, *gathered = weight if isinstance(weight, tuple) else (weight,)
    out = _Fp8Linear.apply(x.reshape(-1, k), weight, recipe, *gathered)
    out = out.reshape(*lead, weight.shape[0])
    return out if bias is None else out + bias.to(out.dtype)
