"""fp8 quantization along each expert's rows in Triton (``fp8_quantize`` with
``group_sizes``): bit for bit the reference's, no host sync.

- blockwise: one program per 128-row tile of the ``ceil(T / 128) + E`` upper bound and per
  column block; it finds its expert and rows as ``grouped_gemm``'s row tiles do, so its scale
  row is its program id, and a program past the last tile stores an all-zero group's scale.
- rowwise and tensorwise: one program per expert and column block loops over the expert's
  rows twice, for the columns' amax and then to scale and cast; tensorwise takes each
  expert's amax from torch first (a max over all columns needs a pass of its own).

Division, rounding and the sign bit by ``fp8_quantize``'s own ``scaled_to_fp8``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._fp8_expert_scales import TILE_ROWS, expert_scale_shape
from .._fp8_recipes import AMAX_EPS, fp8_max
from .fp8_quantize import (
    _MANTISSA,
    _MIN_EXPONENT,
    abs_bits,
    amax_of_bits,
    fp8_bits,
    scale_of,
    scaled_to_fp8,
)
from .grouped_gemm import _find_tile
from .launch import row_max

__all__ = ["quantize_by_expert"]

_BLOCK_C, _BLOCK_R = 64, 64  # columns per program (per-column groups), rows per step


@triton.jit
def _tiles_kernel(
    X, DATA, SCALE, GROUP_SIZES, E, C, stride_xr, stride_xc, stride_sr,
    FP8_MAX: tl.constexpr, EPS: tl.constexpr, MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr, TILE: tl.constexpr, BLOCK_C: tl.constexpr,
    ONE_SCALE: tl.constexpr,
):  # fmt: skip
    tile, col_block = tl.program_id(0), tl.program_id(1)
    _, start, end = _find_tile(GROUP_SIZES, tile, E, TILE)
    rows = start + tl.arange(0, TILE)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < end)[:, None] & (cols < C)[None, :]  # none past the last tile (end 0)
    x = tl.load(
        X + rows[:, None].to(tl.int64) * stride_xr + cols[None, :] * stride_xc,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    amax = row_max(abs_bits(x), axis=0)  # NaN-propagating (abs_bits)
    if ONE_SCALE:  # a 128x128 block
        scale = scale_of(amax_of_bits(row_max(amax, axis=0)), EPS, FP8_MAX)
        y, sign = scaled_to_fp8(x, scale, FP8_MAX, MANTISSA, MIN_EXPONENT)
        tl.store(SCALE + tile * stride_sr + col_block, scale)
    else:  # 128x1 tiles: a scale per column
        scale = scale_of(amax_of_bits(amax), EPS, FP8_MAX)
        y, sign = scaled_to_fp8(x, scale[None, :], FP8_MAX, MANTISSA, MIN_EXPONENT)
        tl.store(SCALE + tile * stride_sr + cols, scale, mask=cols < C)
    data = fp8_bits(y, sign, DATA.dtype.element_ty)
    out = DATA + rows[:, None].to(tl.int64) * C + cols[None, :]
    tl.store(out, data.to(DATA.dtype.element_ty, bitcast=True), mask=mask)


@triton.jit
def _columns_kernel(
    X, DATA, SCALE, AMAX, GROUP_SIZES, ENDS, C, stride_xr, stride_xc,
    FP8_MAX: tl.constexpr, EPS: tl.constexpr, MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    GIVEN_AMAX: tl.constexpr,
):  # fmt: skip
    expert, col_block = tl.program_id(0), tl.program_id(1)
    end = tl.load(ENDS + expert).to(tl.int32)
    start = end - tl.load(GROUP_SIZES + expert).to(tl.int32)
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    if GIVEN_AMAX:  # tensorwise: the expert's amax, one scale
        amax = tl.load(AMAX + expert) + tl.full((BLOCK_C,), 0.0, tl.float32)
    else:
        bits = tl.full((BLOCK_C,), 0, tl.int32)  # NaN-propagating (abs_bits)
        for r0 in range(start, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            mask = (rows < end)[:, None] & col_ok[None, :]
            x = tl.load(
                X + rows[:, None].to(tl.int64) * stride_xr + cols[None, :] * stride_xc,
                mask=mask,
                other=0.0,
            ).to(tl.float32)
            bits = tl.maximum(bits, row_max(abs_bits(x), axis=0))
        amax = amax_of_bits(bits)
    scale = scale_of(amax, EPS, FP8_MAX)
    if GIVEN_AMAX:
        if col_block == 0:
            tl.store(SCALE + expert, row_max(scale, axis=0))
    else:
        tl.store(SCALE + expert.to(tl.int64) * C + cols, scale, mask=col_ok)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & col_ok[None, :]
        x = tl.load(
            X + rows[:, None].to(tl.int64) * stride_xr + cols[None, :] * stride_xc,
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        y, sign = scaled_to_fp8(x, scale[None, :], FP8_MAX, MANTISSA, MIN_EXPONENT)
        data = fp8_bits(y, sign, DATA.dtype.element_ty)
        out = DATA + rows[:, None].to(tl.int64) * C + cols[None, :]
        tl.store(out, data.to(DATA.dtype.element_ty, bitcast=True), mask=mask)


def quantize_by_expert(
    x: torch.Tensor,
    group_sizes: torch.Tensor,
    recipe: str,
    dtype: torch.dtype,
    block: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` as ``d9d.kernels.fp8_quantize`` documents them with ``group_sizes``."""
    (rows, cols), experts = x.shape, group_sizes.shape[0]
    group_sizes = group_sizes.contiguous()  # read as a dense array, like grouped_gemm's
    data = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale = torch.empty(expert_scale_shape(rows, cols, experts, recipe, block), device=x.device)
    if cols == 0 or scale.numel() == 0:
        return data, scale.fill_(AMAX_EPS / fp8_max(dtype))
    numbers = {
        "FP8_MAX": fp8_max(dtype),
        "EPS": AMAX_EPS,
        "MANTISSA": _MANTISSA[dtype],
        "MIN_EXPONENT": _MIN_EXPONENT[dtype],
    }
    if recipe == "blockwise":
        block_c = block[1] if block[1] > 1 else _BLOCK_C
        grid = (scale.shape[0], triton.cdiv(cols, block_c))
        _tiles_kernel[grid](
            x, data, scale, group_sizes, experts, cols, *x.stride(), scale.stride(0),
            **numbers, TILE=TILE_ROWS, BLOCK_C=block_c, ONE_SCALE=block[1] > 1,
        )  # fmt: skip
        return data, scale
    amax = x  # a placeholder pointer, not read, unless tensorwise
    if recipe == "tensorwise":
        row_amax = x.abs().amax(dim=1).float()
        owner = torch.repeat_interleave(
            torch.arange(experts, device=x.device), group_sizes, output_size=rows
        )
        amax = row_amax.new_zeros(experts).scatter_reduce(0, owner, row_amax, "amax")
    grid = (experts, triton.cdiv(cols, _BLOCK_C))
    _columns_kernel[grid](
        x, data, scale, amax, group_sizes, group_sizes.cumsum(0), cols, *x.stride(),
        **numbers, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, GIVEN_AMAX=recipe == "tensorwise",
    )  # fmt: skip
    return data, scale
