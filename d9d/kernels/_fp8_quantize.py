"""``fp8_quantize``: amax, scale and saturating cast to fp8 per recipe; reference and Triton."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import KernelInputError
from . import _fp8_expert_scales
from ._checks import check_floating
from ._fp8_recipes import (
    AMAX_EPS,
    BLOCKS,
    FP8_DTYPES,
    RECIPES,
    expand_scale,
    fp8_max,
    fp8_triton_unavailable,
    group_shape,
    scale_shape,
)
from ._registry import FLOAT_DTYPES, define_op, register_backend, resolve
from ._triton_env import TRITON_DTYPES, triton_auto

__all__ = ["fp8_quantize"]

MAX_ROWWISE_COLS = 65536  # the Triton kernel holds one row of a rowwise group in registers


def reference(
    x: Tensor,
    recipe: str,
    dtype: torch.dtype,
    dim: int,
    block: tuple[int, int],
    group_sizes: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Pads each matrix to whole groups with zeros, takes each group's amax, divides, casts;
    with ``group_sizes``, groups along each expert's rows (``_fp8_expert_scales``)."""
    if group_sizes is not None:
        return _fp8_expert_scales.reference(x, group_sizes, recipe, dtype, block)
    *batch, rows, cols = x.shape
    shape, limit = scale_shape(x.shape, recipe, dim, block), fp8_max(dtype)
    if x.numel() == 0:  # amax 0
        return x.to(dtype), x.new_full(shape, AMAX_EPS / limit, dtype=torch.float32)
    group_rows, group_cols = group_shape(rows, cols, recipe, dim, block)
    n_rows, n_cols = shape[-2:]
    wide = x.float()
    padded = F.pad(wide, (0, n_cols * group_cols - cols, 0, n_rows * group_rows - rows))
    groups = padded.reshape(*batch, n_rows, group_rows, n_cols, group_cols)
    amax = groups.abs().amax(dim=(-3, -1)).clamp(min=AMAX_EPS)
    # A tensor divisor, filled on the device (no host copy: CUDA graphs capture it): CUDA
    # divides by a Python number as a product with its reciprocal, which can differ from the
    # correctly rounded quotient in the last bit.
    scale = amax / torch.full_like(amax, limit)
    full = expand_scale(scale, (group_rows, group_cols), rows, cols)
    return (wide / full).clamp(-limit, limit).to(dtype), scale


@torch.library.custom_op("d9d::fp8_quantize_triton", mutates_args=())
def _triton_quantize(
    x: Tensor, recipe: str, dtype: torch.dtype, dim: int, block_rows: int, block_cols: int
) -> tuple[Tensor, Tensor]:
    from ._triton import fp8_quantize as kernels

    return kernels.quantize(x, recipe, dtype, dim, (block_rows, block_cols))


@_triton_quantize.register_fake
def _(x: Tensor, recipe: str, dtype: torch.dtype, dim: int, block_rows: int, block_cols: int):
    shape = scale_shape(x.shape, recipe, dim, (block_rows, block_cols))
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("d9d::fp8_quantize_by_expert_triton", mutates_args=())
def _triton_by_expert(
    x: Tensor,
    group_sizes: Tensor,
    recipe: str,
    dtype: torch.dtype,
    block_rows: int,
    block_cols: int,
) -> tuple[Tensor, Tensor]:
    from ._triton import fp8_quantize_by_expert as kernels

    return kernels.quantize_by_expert(x, group_sizes, recipe, dtype, (block_rows, block_cols))


@_triton_by_expert.register_fake
def _(x, group_sizes, recipe, dtype, block_rows, block_cols):
    experts, block = group_sizes.shape[0], (block_rows, block_cols)
    shape = _fp8_expert_scales.expert_scale_shape(*x.shape, experts, recipe, block)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(shape, dtype=torch.float32)


def _triton(
    x: Tensor,
    recipe: str,
    dtype: torch.dtype,
    dim: int,
    block: tuple[int, int],
    group_sizes: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    if group_sizes is not None:
        return _triton_by_expert(x, group_sizes, recipe, dtype, *block)
    group_cols = x.shape[-1] if dim == -1 else x.shape[-2]
    if recipe == "rowwise" and group_cols > MAX_ROWWISE_COLS:
        raise KernelInputError(
            f"fp8_quantize: the triton backend holds a rowwise group in registers: "
            f"{group_cols} elements > {MAX_ROWWISE_COLS}; use backend='reference'"
        )
    return _triton_quantize(x, recipe, dtype, dim, *block)


def _check(x: Tensor, recipe: str, dtype: torch.dtype, dim: int, block) -> None:
    check_floating("fp8_quantize", x=x)
    if x.dim() not in (2, 3):
        raise KernelInputError(
            f"fp8_quantize: x must be a [rows, cols] matrix or a [batch, rows, cols] stack of "
            f"them (e.g. experts' weights), got {x.shape=}"
        )
    if recipe not in RECIPES:
        raise KernelInputError(f"fp8_quantize: unknown {recipe=}; recipes are {list(RECIPES)}")
    if dtype not in FP8_DTYPES:
        raise KernelInputError(
            f"fp8_quantize: {dtype=} is not an fp8 dtype; use torch.float8_e4m3fn or "
            f"torch.float8_e5m2"
        )
    if dim not in (-1, -2):
        raise KernelInputError(
            f"fp8_quantize: {dim=}: a rowwise scale runs along dim -1 (one per row) or -2 "
            f"(one per column)"
        )
    if tuple(block) not in BLOCKS:
        raise KernelInputError(f"fp8_quantize: {block=} is not one of {list(BLOCKS)}")


def _check_by_expert(x: Tensor, recipe: str, dim: int, block, group_sizes: Tensor) -> None:
    """``group_sizes``' own rules: scale groups along the rows of a matrix, within experts."""
    if x.dim() != 2:
        raise KernelInputError(
            f"fp8_quantize: with group_sizes, x must be a [T, cols] matrix of rows grouped by "
            f"expert, got {x.shape=}"
        )
    sizes_ok = isinstance(group_sizes, Tensor) and group_sizes.dim() == 1
    if not sizes_ok or group_sizes.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(
            f"fp8_quantize: group_sizes must be an [E] int32 or int64 tensor, got "
            f"{getattr(group_sizes, 'shape', group_sizes)}, {getattr(group_sizes, 'dtype', '')}"
        )
    if group_sizes.device != x.device:
        raise KernelInputError(
            f"fp8_quantize: group_sizes on {group_sizes.device}, x on {x.device}: move them "
            f"to one device"
        )
    if recipe == "rowwise" and dim != -2:
        raise KernelInputError(
            f"fp8_quantize: rowwise with group_sizes scales each expert's columns: pass dim=-2, "
            f"got {dim=} (a scale per row needs no group_sizes)"
        )
    if recipe == "blockwise" and block[0] != _fp8_expert_scales.TILE_ROWS:
        raise KernelInputError(
            f"fp8_quantize: blockwise with group_sizes tiles 128 rows of each expert: pass "
            f"block=(128, 1) or (128, 128), got {block=} (1x128 tiles need no group_sizes)"
        )


def fp8_quantize(
    x: Tensor,
    recipe: str,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    dim: int = -1,
    block: tuple[int, int] = (1, 128),
    group_sizes: Tensor | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Casts ``x`` to fp8 with float32 scales: amax per group, scale, saturating cast.

    ``scale = max(amax, 1e-12) / fp8_max`` per group of elements and ``data = clamp(x / scale,
    -fp8_max, fp8_max)`` rounded to nearest-even, so ``x ~= data.float() * scale`` (the scale
    dequantizes, as ``torch._scaled_mm`` takes it). A group of zeros gives data 0. Groups:
    ``"tensorwise"``, the whole matrix; ``"rowwise"``, a row (``dim=-1``) or a column
    (``dim=-2``); ``"blockwise"``, tiles of ``block`` (DeepSeek-V3: ``(1, 128)`` for
    activations, ``(128, 128)`` for weights), the last ones ragged when the dims are not
    multiples of 128. A 3-d ``x`` is a stack of matrices (experts), each scaled apart. Not
    differentiable: ``x`` is detached.

    With ``group_sizes``, ``x [T, cols]`` has its rows grouped by expert (as ``grouped_gemm``'s)
    and every group runs along the rows within one expert: the operands of
    ``fp8_grouped_gemm_k`` (an expert's weight grad). Each expert's data and scales are then
    ``fp8_quantize`` of its rows alone; blockwise tiles of 128 rows start at each expert's
    first row. The scales' shapes need no host sync (Returns).

    Args:
        x: ``[rows, cols]`` or ``[batch, rows, cols]`` float tensor.
        recipe: ``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``.
        dtype: ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2``.
        dim: rowwise only: the dim a scale runs along, -1 (a scale per row) or -2 (per column).
        block: blockwise only: ``(1, 128)`` (default), ``(128, 1)`` or ``(128, 128)``.
        group_sizes: ``[E]`` int32/int64 tensor on ``x``'s device, rows per expert (summing
            to ``T``, unchecked); needs ``dim=-2`` (rowwise) or ``block[0] == 128``
            (blockwise).
        backend: ``"triton"``, ``"reference"``, ``"auto"`` or None (see ``d9d.kernels.use``).

    Returns:
        ``(data, scale)``: ``data`` of ``x``'s shape in ``dtype``; ``scale`` float32 of shape
        ``[..., 1, 1]`` (tensorwise), ``[..., rows, 1]`` or ``[..., 1, cols]`` (rowwise),
        ``[..., ceil(rows / block[0]), ceil(cols / block[1])]`` (blockwise). With
        ``group_sizes``: ``[E, 1, 1]``, ``[E, 1, cols]``, ``[ceil(T / 128) + E, ceil(cols /
        block[1])]`` (expert ``e``'s ``j``-th tile at row ``sum(ceil(group_sizes[:e] / 128))
        + j``; the rows left over hold an all-zero group's scale).

    Raises:
        KernelInputError: ``x`` not a float matrix (or stack), an unknown recipe, a dtype
            that is not fp8, a ``dim``/``block`` not listed above, or a ``group_sizes`` that
            is not ``[E]`` integers beside a matrix, or beside rowwise scales per row or
            1x128 tiles.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d.kernels as K
        >>> data, scale = K.fp8_quantize(torch.tensor([[1.0, -2.0], [0.5, 0.0]]), "rowwise")
        >>> data.float() * scale
        tensor([[ 1.0000, -2.0000],
                [ 0.5000,  0.0000]])
    """
    block = tuple(block)
    _check(x, recipe, dtype, dim, block)
    if group_sizes is None:
        return resolve("fp8_quantize", x, backend, recipe)(x.detach(), recipe, dtype, dim, block)
    _check_by_expert(x, recipe, dim, block, group_sizes)
    impl = resolve("fp8_quantize", x, backend, recipe)
    return impl(x.detach(), recipe, dtype, dim, block, group_sizes)


define_op("fp8_quantize", reference, dtypes=FLOAT_DTYPES)
register_backend(
    "fp8_quantize",
    "triton",
    _triton,
    dtypes=TRITON_DTYPES,
    unavailable=fp8_triton_unavailable,
    auto=triton_auto,
)
