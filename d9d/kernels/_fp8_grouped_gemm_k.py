"""``fp8_grouped_gemm_k``: the fp8 GEMM grouped along K (the tokens), an MoE expert's weight
grad ``dw[e] = x[rows of e].T @ dy[rows of e]``; a reference that dequantizes to float32 and
loops over experts, and a Triton kernel of one launch."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import KernelInputError
from . import _fp8_expert_scales as expert_scales
from ._fp8_gemm import OUT_DTYPES
from ._fp8_recipes import FP8_DTYPES, RECIPES, fp8_triton_unavailable
from ._registry import define_op, register_backend, resolve
from ._triton_env import triton_auto

__all__ = ["fp8_grouped_gemm_k"]


def _block(recipe: str, scale: Tensor, cols: int) -> tuple[int, int]:
    """A blockwise operand's tile, told by its scale's width: ``(128, 1)`` when a scale per
    column (the two agree for one column), else ``(128, 128)``."""
    return (128, 1) if recipe == "blockwise" and scale.shape[1] == cols else (128, 128)


def dequantize_by_expert(data: Tensor, scale: Tensor, group_sizes: Tensor, recipe: str) -> Tensor:
    """``[T, cols]`` float32: ``data`` times its scales, quantized by expert along the rows
    (``fp8_quantize(..., group_sizes=)``'s layout)."""
    rows, cols = data.shape
    block = _block(recipe, scale, cols)
    return data.float() * expert_scales.expand(scale, group_sizes, recipe, block, rows, cols)


def reference(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    group_sizes: Tensor,
    recipe: str,
    out_dtype: torch.dtype,
) -> Tensor:
    """Each expert's ``a.T @ b`` over its rows, the operands dequantized to float32 (the other
    experts' rows of both masked: ``E`` times the work, no host sync; ``b`` unmasked, a NaN
    in one expert's rows made every expert's output NaN, ``0 * NaN``)."""
    a_wide = dequantize_by_expert(a, a_scale, group_sizes, recipe)
    b_wide = dequantize_by_expert(b, b_scale, group_sizes, recipe)
    ends, rows = group_sizes.cumsum(0), torch.arange(a.shape[0], device=a.device)
    out = []
    for e in range(group_sizes.shape[0]):
        mine = (rows >= ends[e] - group_sizes[e]) & (rows < ends[e])
        mask = mine[:, None]
        out.append(torch.where(mask, a_wide, 0.0).t() @ torch.where(mask, b_wide, 0.0))
    if not out:
        return a.new_empty(0, a.shape[1], b.shape[1], dtype=out_dtype)
    return torch.stack(out).to(out_dtype)


@torch.library.custom_op("d9d::fp8_grouped_gemm_k_triton", mutates_args=())
def _triton(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    group_sizes: Tensor,
    recipe: str,
    out_dtype: torch.dtype,
) -> Tensor:
    from ._triton import fp8_gemm_k as kernels

    experts = group_sizes.shape[0]
    if recipe != "blockwise":  # [E, 1, cols] rows of scales, one per expert: 2-d views
        a_scale = a_scale.expand(experts, 1, a.shape[1])[:, 0]
        b_scale = b_scale.expand(experts, 1, b.shape[1])[:, 0]
    first_tiles = expert_scales.first_tiles(group_sizes)
    return kernels.gemm_k(a, a_scale, b, b_scale, group_sizes, first_tiles, recipe, out_dtype)


@_triton.register_fake
def _(a, a_scale, b, b_scale, group_sizes, recipe, out_dtype):
    return a.new_empty(group_sizes.shape[0], a.shape[1], b.shape[1], dtype=out_dtype)


def _check_scale(name: str, scale: Tensor, data: Tensor, experts: int, recipe: str) -> None:
    rows, cols = data.shape
    blocks = ((128, 1), (128, 128)) if recipe == "blockwise" else ((128, 128),)
    allowed = [expert_scales.expert_scale_shape(rows, cols, experts, recipe, b) for b in blocks]
    if not isinstance(scale, Tensor) or scale.dtype != torch.float32:
        raise KernelInputError(
            f"fp8_grouped_gemm_k: {name} must be a float32 tensor, got "
            f"{getattr(scale, 'dtype', type(scale))}"
        )
    if tuple(scale.shape) not in allowed:
        raise KernelInputError(
            f"fp8_grouped_gemm_k: {name}.shape={tuple(scale.shape)}, expected one of {allowed} "
            f"for {recipe=} (fp8_quantize with group_sizes gives it)"
        )


def _check(a, a_scale, b, b_scale, group_sizes, recipe, out_dtype) -> None:
    for name, data in (("a_data", a), ("b_data", b)):
        if not isinstance(data, Tensor) or data.dtype not in FP8_DTYPES or data.dim() != 2:
            raise KernelInputError(
                f"fp8_grouped_gemm_k: {name} must be a [T, cols] float8_e4m3fn or float8_e5m2 "
                f"matrix (fp8_quantize's data), got {getattr(data, 'dtype', type(data))} "
                f"{tuple(getattr(data, 'shape', ()))}"
            )
    if a.shape[0] != b.shape[0]:
        raise KernelInputError(
            f"fp8_grouped_gemm_k: a_data [T, M] and b_data [T, N] share their rows (the "
            f"tokens), got {a.shape=}, {b.shape=}"
        )
    if recipe not in RECIPES:
        raise KernelInputError(f"fp8_grouped_gemm_k: unknown {recipe=}; recipes are {RECIPES}")
    if out_dtype not in OUT_DTYPES:
        raise KernelInputError(f"fp8_grouped_gemm_k: {out_dtype=} is not one of {OUT_DTYPES}")
    if group_sizes.dim() != 1 or group_sizes.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(
            f"fp8_grouped_gemm_k: group_sizes must be an [E] int32 or int64 tensor, got "
            f"{group_sizes.shape=}, {group_sizes.dtype=}"
        )
    devices = {
        "a_data": a.device,
        "a_scale": a_scale.device,
        "b_data": b.device,
        "b_scale": b_scale.device,
        "group_sizes": group_sizes.device,
    }
    if len(set(devices.values())) > 1:
        raise KernelInputError(f"fp8_grouped_gemm_k: tensors on different devices: {devices}")
    _check_scale("a_scale", a_scale, a, group_sizes.shape[0], recipe)
    _check_scale("b_scale", b_scale, b, group_sizes.shape[0], recipe)


def fp8_grouped_gemm_k(
    a_data: Tensor,
    a_scale: Tensor,
    b_data: Tensor,
    b_scale: Tensor,
    group_sizes: Tensor,
    recipe: str,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str | None = None,
) -> Tensor:
    """fp8 GEMM grouped along K: ``out[e] = (a[rows of e] * a_scale).T @ (b[rows of e] *
    b_scale)``, summing only expert ``e``'s rows (an MoE expert's weight grad).

    Rows are grouped by expert as in ``grouped_gemm`` (``group_sizes`` stays on the device
    and must sum to ``T``, unchecked); an expert without rows gets zeros. Both operands are
    ``fp8_quantize(..., group_sizes=group_sizes)``'s outputs, their scale groups along the
    rows within each expert: one scale per expert (tensorwise), per column of each expert's
    rows (rowwise, ``dim=-2``), per 128-row tile from each expert's first row and per column
    (``block=(128, 1)``) or 128 columns (``block=(128, 128)``) (blockwise). Float32
    accumulation. Not differentiable.

    Args:
        a_data: ``[T, M]`` fp8 tensor (e.g. the activations ``x``).
        a_scale: float32; ``[E, 1, 1]``, ``[E, 1, M]``, or ``[ceil(T/128) + E, M]`` or
            ``[ceil(T/128) + E, ceil(M/128)]``.
        b_data: ``[T, N]`` fp8 tensor (e.g. the output grad ``dy``).
        b_scale: float32; as ``a_scale`` with ``N``.
        group_sizes: ``[E]`` int32 or int64 tensor, rows per expert.
        recipe: ``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``.
        out_dtype: float32, bfloat16 (default) or float16.
        backend: ``"triton"``, ``"reference"``, ``"auto"`` or None (see ``d9d.kernels.use``).

    Returns:
        ``[E, M, N]`` tensor of ``out_dtype``.

    Raises:
        KernelInputError: data not fp8 matrices with the same rows, scales not float32 or of
            the wrong shape, an unknown recipe or ``out_dtype``, a ``group_sizes`` that is not
            ``[E]`` integers, tensors on different devices.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d.kernels as K
        >>> sizes = torch.tensor([1, 0, 2])
        >>> x = K.fp8_quantize(torch.ones(3, 4), "rowwise", dim=-2, group_sizes=sizes)
        >>> dy = K.fp8_quantize(torch.ones(3, 2), "rowwise", dim=-2, group_sizes=sizes)
        >>> K.fp8_grouped_gemm_k(*x, *dy, sizes, "rowwise", torch.float32)[:, 0, 0]
        tensor([1., 0., 2.])
    """
    _check(a_data, a_scale, b_data, b_scale, group_sizes, recipe, out_dtype)
    impl = resolve("fp8_grouped_gemm_k", a_data, backend, recipe)
    return impl(a_data, a_scale, b_data, b_scale, group_sizes, recipe, out_dtype)


define_op("fp8_grouped_gemm_k", reference, dtypes=FP8_DTYPES)
register_backend(
    "fp8_grouped_gemm_k",
    "triton",
    _triton,
    dtypes=FP8_DTYPES,
    unavailable=fp8_triton_unavailable,
    auto=triton_auto,
)
