"""fp8 quantization in Triton: each program loads one tile, takes the amax of each scale group
in it, divides and stores the fp8 data and the scales, in one pass over ``x``.

A program's tile is ``BLOCK_R`` rows by one column group (128 columns for blockwise, a whole
row for rowwise). Per-column groups (rowwise along dim -2, 128x1 tiles) run the same kernel on
the transposed views. Tensorwise takes its amax from one torch reduction first (a global max
needs a pass of its own) and the kernel then scales and casts.

The cast is bit-exact with torch's: the kernel rounds to nearest-even onto the fp8 grid in
float32 itself (``_round_to_fp8``), so the final conversion is exact whatever rounding the
conversion uses (Triton's interpreter truncates when it converts to fp8, where torch and the
GPU round to nearest-even), and sets the sign bit itself, so a negative value that rounds to
zero is -0.0 as in torch (compiled for an H200, e4m3 data came out +0.0 there without it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._fp8_recipes import AMAX_EPS, fp8_max, scale_shape
from .launch import num_warps, row_max, tile_rows

__all__ = ["quantize"]

_MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
_MIN_EXPONENT = {torch.float8_e4m3fn: -6, torch.float8_e5m2: -14}  # of the smallest normal


@triton.jit
def _round_to_fp8(y, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """``y`` (float32, finite, within the format's range) rounded to nearest-even onto the fp8
    grid: adding and subtracting ``1.5 * 2**23`` units of the grid's spacing at ``|y|``."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    spacing = tl.maximum(exponent, MIN_EXPONENT) - MANTISSA
    magic = (((spacing + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    rounded = (tl.abs(y) + magic) - magic
    return tl.where(bits < 0, -rounded, rounded)


@triton.jit
def abs_bits(x):
    """``|x|``'s float32 bits as int32, ordered as the magnitudes with a NaN above +inf: the
    integer max of these is the amax, NaN where the group holds one (as torch's ``amax``).
    A float max drops a NaN (on the GPU and in the interpreter): a NaN in ``x`` gave a finite
    scale and finite data, where the reference gives NaN."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def amax_of_bits(bits):
    """The float32 amax of :func:`abs_bits` values' max."""
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def scale_of(amax, EPS: tl.constexpr, FP8_MAX: tl.constexpr):
    """``max(amax, EPS) / FP8_MAX``, NaN for a NaN amax (``tl.maximum`` would give EPS)."""
    return tl.div_rn(tl.where(amax < EPS, EPS, amax), FP8_MAX)


@triton.jit
def scaled_to_fp8(
    x, scale, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr
):
    """``(x / scale saturated and rounded onto the fp8 grid, x's sign bit as uint8)``: the
    caller ORs the sign into the fp8 bits, so that what rounds to zero keeps its sign
    (compiled for an H200, e4m3 data of a negative value that rounded to zero came out +0.0
    without it)."""
    y = tl.div_rn(x, scale)
    # A NaN quotient (x NaN or infinite, or a NaN scale) stays NaN: the clamp would make it
    # +-FP8_MAX.
    saturated = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
    y = _round_to_fp8(saturated, MANTISSA, MIN_EXPONENT)
    return y, ((x.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)


@triton.jit
def fp8_bits(y, sign, DTYPE: tl.constexpr):
    """The fp8 bits (uint8) of :func:`scaled_to_fp8`'s ``(y, sign)``; a NaN ``y`` gives 0x7F
    (NaN in both formats, as torch casts it): the interpreter's conversion to e4m3 made a
    NaN finite."""
    bits = y.to(DTYPE).to(tl.uint8, bitcast=True) | sign
    return bits | tl.where(y != y, 0x7F, 0).to(tl.uint8)


@triton.jit
def _quantize_kernel(
    X, DATA, SCALE, AMAX, R, C, group_cols,
    stride_xb, stride_xr, stride_xc, stride_db, stride_dr, stride_dc,
    stride_sb, stride_sr, stride_sc,
    FP8_MAX: tl.constexpr, EPS: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROWS_SHARE: tl.constexpr,
    GIVEN_AMAX: tl.constexpr,
):  # fmt: skip
    tile_r, group, matrix = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tile_r * BLOCK_R + tl.arange(0, BLOCK_R)
    first = group * group_cols
    cols = first + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & ((cols < C) & (cols < first + group_cols))[None, :]
    x = tl.load(
        X + matrix.to(tl.int64) * stride_xb + rows[:, None].to(tl.int64) * stride_xr
        + cols[None, :] * stride_xc,
        mask=mask,
        other=0.0,
    ).to(tl.float32)  # fmt: skip
    if GIVEN_AMAX:
        scale = scale_of(tl.load(AMAX + matrix), EPS, FP8_MAX)
        y, sign = scaled_to_fp8(x, scale, FP8_MAX, MANTISSA, MIN_EXPONENT)
    elif ROWS_SHARE:
        amax = amax_of_bits(row_max(row_max(abs_bits(x), axis=1), axis=0))
        scale = scale_of(amax, EPS, FP8_MAX)
        y, sign = scaled_to_fp8(x, scale, FP8_MAX, MANTISSA, MIN_EXPONENT)
    else:
        scale = scale_of(amax_of_bits(row_max(abs_bits(x), axis=1)), EPS, FP8_MAX)
        y, sign = scaled_to_fp8(x, scale[:, None], FP8_MAX, MANTISSA, MIN_EXPONENT)
    data = fp8_bits(y, sign, DATA.dtype.element_ty)
    tl.store(
        DATA + matrix.to(tl.int64) * stride_db + rows[:, None].to(tl.int64) * stride_dr
        + cols[None, :] * stride_dc,
        data.to(DATA.dtype.element_ty, bitcast=True),
        mask=mask,
    )  # fmt: skip
    scales = SCALE + matrix * stride_sb
    if GIVEN_AMAX:
        if (tile_r == 0) & (group == 0):
            tl.store(scales, scale)
    elif ROWS_SHARE:
        tl.store(scales + tile_r * stride_sr + group * stride_sc, scale)
    else:
        tl.store(scales + rows * stride_sr + group * stride_sc, scale, mask=rows < R)


def quantize(
    x: torch.Tensor, recipe: str, dtype: torch.dtype, dim: int, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` as ``d9d.kernels.fp8_quantize`` documents them."""
    data = torch.empty(x.shape, dtype=dtype, device=x.device)
    scale = torch.empty(scale_shape(x.shape, recipe, dim, block), device=x.device)
    if x.numel() == 0:
        return data, scale.fill_(AMAX_EPS / fp8_max(dtype))
    x3, data3, scale3 = (t if t.dim() == 3 else t[None] for t in (x, data, scale))
    if (recipe == "rowwise" and dim == -2) or (recipe == "blockwise" and block == (128, 1)):
        # A column's group is a row of the transposed matrix.
        x3, data3, scale3 = (t.transpose(1, 2) for t in (x3, data3, scale3))
        block = (1, 128)
    matrices, rows, cols = x3.shape
    amax = x3  # a placeholder pointer, not read, unless tensorwise
    match recipe:
        case "tensorwise":
            amax = torch.linalg.vector_norm(x3, float("inf"), dim=(1, 2), dtype=torch.float32)
            group_cols = block_c = min(triton.next_power_of_2(cols), 1024)
            block_r = tile_rows(block_c, rows)
        case "rowwise":
            group_cols = cols
            block_c = triton.next_power_of_2(cols)
            block_r = tile_rows(block_c, rows)
        case _:
            group_cols = block_c = block[1]
            block_r = block[0] if block[0] > 1 else tile_rows(block_c, rows)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(cols, group_cols), matrices)
    _quantize_kernel[grid](
        x3, data3, scale3, amax, rows, cols, group_cols,
        *x3.stride(), *data3.stride(), *scale3.stride(),
        FP8_MAX=fp8_max(dtype), EPS=AMAX_EPS, MANTISSA=_MANTISSA[dtype],
        MIN_EXPONENT=_MIN_EXPONENT[dtype], BLOCK_R=block_r, BLOCK_C=block_c,
        ROWS_SHARE=recipe == "blockwise" and block[0] > 1,
        GIVEN_AMAX=recipe == "tensorwise", num_warps=num_warps(block_r * block_c),
    )  # fmt: skip
    return data, scale
