"""The routed experts' grouped GEMM in fp8: what ``fp8`` sets as a ``d9d.moe`` experts
module's ``gemm`` for one call.

For ``y[rows of e] = x[rows of e] @ w[e]`` (``x [T, K]`` rows grouped by expert, ``w [E, K,
N]``, ``group_sizes [E]`` on the device):

- output ``y``: ``x`` quantized along ``K``, ``w[e]`` along ``K``; ``fp8_grouped_gemm``;
- input grad ``dx = dy @ w[e].T``: ``dy`` along ``N`` (the grad format), ``w[e].T`` along
  ``N``; ``fp8_grouped_gemm``;
- weight grad ``dw[e] = x[rows of e].T @ dy[rows of e]``, a sum over the expert's tokens:
  ``x`` and ``dy`` each quantized once along the tokens within each expert's rows
  (``fp8_quantize`` with ``group_sizes``), then one ``fp8_grouped_gemm_k``: each token row
  is read once, not once per expert, and no host sync.

Scales per recipe: ``tensorwise`` has one scale per expert for each operand (the amax of the
expert's rows, of its weight; computed by the rowwise kernel with each row given its expert's
scale); ``rowwise`` and ``blockwise`` as for linears (a row, 1x128 tiles; a weight's column,
128x128 blocks of each expert). In the weight grad, ``rowwise`` scales each column of an
expert's rows, ``blockwise`` takes 128-token tiles from each expert's first row (``dy``
128x1, ``x`` 128x128), so no scale group straddles two experts. e4m3 for activations and weights, the recipe's grad format
(``GRAD_DTYPES``) for ``dy``. The forward saves ``x`` and ``w`` in their own dtype; the output
has ``x``'s dtype and the weight grad ``w``'s.

A weight all-gathered in fp8 (``_gather``, tensorwise: an :class:`Fp8Weight` of e4m3 data
and a scale per expert, or under ``d9d.jit`` the codec's ``(weight, data, scale)``) is the
output's and the input grad's ``b`` as it is: the quantization of ``w[e]`` and ``w[e].T``
alike, laid out with the contraction fastest as ``_quantize_b`` lays it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...kernels import fp8_grouped_gemm, fp8_grouped_gemm_k, fp8_quantize
from ._linear import E4M3, GRAD_DTYPES
from ._weight import Fp8Weight

__all__ = ["fp8_grouped_gemm_experts"]

_AMAX_EPS = 1e-12  # fp8_quantize's: an expert without rows gets a tiny scale, never 0


def _expert_of_rows(group_sizes: Tensor, rows: int) -> Tensor:
    """``[rows]``: the expert each row belongs to (no host sync)."""
    experts = torch.arange(group_sizes.numel(), device=group_sizes.device)
    return torch.repeat_interleave(experts, group_sizes, output_size=rows)


def _per_expert_scales(x: Tensor, owner: Tensor, experts: int, dtype: torch.dtype) -> Tensor:
    """``[rows, 1]``: each row's expert's tensorwise scale (the amax of that expert's rows)."""
    row_amax = x.detach().abs().amax(dim=1).float()
    amax = row_amax.new_zeros(experts).scatter_reduce(0, owner, row_amax, "amax")
    return (amax.clamp(min=_AMAX_EPS) / torch.finfo(dtype).max)[owner, None]


def _quantize_a(
    x: Tensor, owner: Tensor, experts: int, recipe: str, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``x [rows, k]`` (rows grouped by expert) as the grouped GEMM's ``a``, along ``k``."""
    if recipe != "tensorwise":
        return fp8_quantize(x, recipe, dtype)
    # No branch on zero rows (a rank whose experts receive none): the ops below give [0, k]
    # data and [0, 1] scales, and under d9d.jit the rows are an unbacked size that Dynamo
    # cannot compare with 0.
    scale, limit = _per_expert_scales(x, owner, experts, dtype), torch.finfo(dtype).max
    return (x.detach().float() / scale).clamp(-limit, limit).to(dtype), scale


def _quantize_b(w: Tensor, recipe: str) -> tuple[Tensor, Tensor]:
    """``w [E, k, n]`` as the grouped GEMM's ``b``: each expert along ``k`` in e4m3, its data
    laid out ``k`` fastest (quantized as ``[E, n, k]`` rows, returned as a transposed view:
    the same groups and values as along ``dim=-2``); a tensorwise scale broadcast to the
    rowwise kernel's ``[E, 1, n]``.

    ``k`` fastest is the layout Hopper's fp8 tensor cores read: on an H200 the Triton fp8
    GEMM ran at 827 TFLOP/s with such a ``b`` and its grouped form at 99 with ``n`` fastest
    (``docs/kernels.md``)."""
    data, scale = fp8_quantize(w.transpose(1, 2), recipe, E4M3, block=(128, 128))
    data, scale = data.transpose(1, 2), scale.transpose(1, 2)
    return data, scale.expand(w.shape[0], 1, w.shape[2]) if recipe == "tensorwise" else scale


def _weight_as_b(
    w: Tensor, gathered: tuple[Tensor, ...], recipe: str, *, transposed: bool
) -> tuple[Tensor, Tensor]:
    """``w [E, K, N]`` (the output's ``b``) or ``w.transpose(1, 2)`` (the input grad's) as
    the grouped GEMM's ``b``: quantized by :func:`_quantize_b`, or, gathered in fp8 (an
    :class:`Fp8Weight`, or its data and scale in ``gathered``), that quantization already:
    the same data (copied with the contraction fastest where it is not) and scale."""
    if isinstance(w, Fp8Weight):
        gathered = (w.fp8_data, w.fp8_scale)
    if not gathered:
        return _quantize_b(w.transpose(1, 2) if transposed else w, recipe)
    data, scale = gathered
    data = data.transpose(1, 2) if transposed else data
    data = data.transpose(1, 2).contiguous().transpose(1, 2)
    return data, scale.expand(data.shape[0], 1, data.shape[2])


def _grouped(
    a: Tensor,
    b: tuple[Tensor, Tensor],
    group_sizes: Tensor,
    owner: Tensor,
    recipe: str,
    a_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> Tensor:
    """``a [T, k]`` rows of expert ``e`` times ``b[e] [k, n]`` (quantized along ``k``:
    :func:`_weight_as_b`), ``a`` quantized along ``k``."""
    a_data, a_scale = _quantize_a(a, owner, b[0].shape[0], recipe, a_dtype)
    # Per-expert tensorwise scales are per-row and per-column scales of equal values.
    kernel_recipe = "rowwise" if recipe == "tensorwise" else recipe
    return fp8_grouped_gemm(a_data, a_scale, *b, group_sizes, kernel_recipe, out_dtype)


def _weight_grad(x: Tensor, grad: Tensor, group_sizes: Tensor, recipe: str, dtype) -> Tensor:
    """``[E, K, N]``: each expert's ``x.T @ grad`` over its rows (module doc)."""
    by_expert = {"dim": -2, "group_sizes": group_sizes}
    a = fp8_quantize(x, recipe, E4M3, block=(128, 128), **by_expert)
    b = fp8_quantize(grad, recipe, GRAD_DTYPES[recipe], block=(128, 1), **by_expert)
    return fp8_grouped_gemm_k(*a, *b, group_sizes, recipe, dtype)


class _Fp8GroupedGemm(torch.autograd.Function):
    """``grouped_gemm(x, w, group_sizes)`` with its three matmuls in fp8."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, w: Tensor, group_sizes: Tensor, recipe: str, *gathered: Tensor
    ) -> Tensor:
        owner = _expert_of_rows(group_sizes, x.shape[0])
        ctx.save_for_backward(x, w, group_sizes, owner, *gathered)
        ctx.recipe = recipe
        b = _weight_as_b(w, gathered, recipe, transposed=False)
        return _grouped(x, b, group_sizes, owner, recipe, E4M3, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, w, group_sizes, owner, *gathered = ctx.saved_tensors
        recipe, grad_dtype = ctx.recipe, GRAD_DTYPES[ctx.recipe]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            b = _weight_as_b(w, tuple(gathered), recipe, transposed=True)
            grad_x = _grouped(grad, b, group_sizes, owner, recipe, grad_dtype, x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(x, grad, group_sizes, recipe, w.dtype)
        return grad_x, grad_w, None, None, *([None] * len(gathered))


def fp8_grouped_gemm_experts(
    x: Tensor, w: Tensor | tuple[Tensor, Tensor, Tensor], group_sizes: Tensor, recipe: str
) -> Tensor:
    """``d9d.kernels.grouped_gemm(x, w, group_sizes)`` with the output, input grad and weight
    grad computed in fp8 under ``recipe`` (module doc); the output in ``x``'s dtype. ``w``
    may be one gathered in fp8: an :class:`Fp8Weight`, or under ``d9d.jit`` the gather
    codec's ``(weight, data, scale)`` (``_gather``).

    Example:
        >>> x, w = torch.randn(5, 32), torch.randn(3, 32, 16)
        >>> fp8_grouped_gemm_experts(x, w, torch.tensor([2, 0, 3]), "tensorwise").shape
        torch.Size([5, 16])
    """
    w, *gathered = w if isinstance(w, tuple) else (w,)
    return _Fp8GroupedGemm.apply(x, w, group_sizes, recipe, *gathered)
