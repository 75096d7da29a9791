"""fp8 GEMM in Triton, dense and grouped by expert, with float32 accumulation.

One kernel serves both: a dense GEMM is a grouped one with one expert. Row tiles find their
expert as in ``grouped_gemm`` (no host sync). Tensorwise and rowwise scales multiply the
accumulator once, at the end; blockwise scales (1x128 for ``a``, 128x128 for ``b``) multiply
each 128-deep partial product before it is added. Every recipe adds its 128-deep partial
products in float32 outside the tensor cores, as DeepSeek-V3 promotes its partial sums: on
Hopper an fp8 ``tl.dot`` accumulates in fewer bits than float32 (about 14, DeepSeek-V3
measured), an error that would otherwise grow with K. A scale is read through strides, so a tensorwise scale is a
broadcast view (stride 0) and costs no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grouped_gemm import _find_tile
from .launch import INTERPRETING

__all__ = ["gemm"]

# BLOCK_K is the blockwise scale's 128: each K step is one scale tile. The interpreter
# computes fp8 tl.dot wrongly like bfloat16, so there both operands go to float32 (UPCAST).
_BLOCK_M, _BLOCK_N, _BLOCK_K = 64, 128, 128


@triton.jit
def _fp8_gemm_kernel(
    A, B, A_SCALE, B_SCALE, GROUP_SIZES, OUT, E, K, N,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn,
    stride_asm, stride_ask, stride_bse, stride_bsk, stride_bsn,
    B_SCALE_COLS: tl.constexpr, PER_K_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    expert, start, end = _find_tile(GROUP_SIZES, tl.program_id(0), E, BLOCK_M)
    if expert >= 0:
        rows = start + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < end, cols < N
        a_scales = A_SCALE + rows.to(tl.int64) * stride_asm
        b_scales = B_SCALE + expert.to(tl.int64) * stride_bse + (cols // B_SCALE_COLS) * stride_bsn
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(
                A + rows[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak,
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                B + expert.to(tl.int64) * stride_be + ks[:, None] * stride_bk
                + cols[None, :] * stride_bn,
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )  # fmt: skip
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            # A fresh partial per K tile: Hopper's fp8 tensor cores sum in fewer bits than
            # float32, so the running sum is kept in float32 outside them.
            partial = tl.dot(a, b, input_precision="ieee" if UPCAST else "tf32")
            if PER_K_TILE:
                tile = k0 // BLOCK_K
                a_scale = tl.load(a_scales + tile * stride_ask, mask=row_ok, other=0.0)
                b_scale = tl.load(b_scales + tile * stride_bsk, mask=col_ok, other=0.0)
                acc += partial * a_scale[:, None] * b_scale[None, :]
            else:
                acc += partial
        if not PER_K_TILE:
            a_scale = tl.load(a_scales, mask=row_ok, other=0.0)
            b_scale = tl.load(b_scales, mask=col_ok, other=0.0)
            acc = acc * a_scale[:, None] * b_scale[None, :]
        out = OUT + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_sizes: torch.Tensor,
    recipe: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[T, N]``: ``a [T, K]`` times ``b [E, K, N]`` per expert's rows, scales as validated by
    ``d9d.kernels.fp8_grouped_gemm`` (``a_scale`` 2-d, ``b_scale`` 3-d)."""
    (rows, k), (experts, _, n) = a.shape, b.shape
    group_sizes = group_sizes.contiguous()  # read as a dense array, like grouped_gemm's
    out = torch.empty(rows, n, dtype=out_dtype, device=a.device)
    if rows == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    grid = (triton.cdiv(rows, _BLOCK_M) + experts, triton.cdiv(n, _BLOCK_N))
    _fp8_gemm_kernel[grid](
        a, b, a_scale, b_scale, group_sizes, out, experts, k, n,
        *a.stride(), *b.stride(), *a_scale.stride(), *b_scale.stride(),
        B_SCALE_COLS=128 if recipe == "blockwise" else 1, PER_K_TILE=recipe == "blockwise",
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, UPCAST=INTERPRETING,
    )  # fmt: skip
    return out
