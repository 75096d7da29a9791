"""fp8 GEMM grouped along K in Triton: ``out[e] = a[rows of e].T @ b[rows of e]``, an
expert's weight grad, with float32 accumulation, in one launch and no host sync.

One program per ``(expert, M tile, N tile)`` loops over its expert's rows 128 at a time, as
``grouped_gemm``'s weight grad does; ``ends`` and the first blockwise tile of each expert are
cumulative sums taken on the device. Each 128-deep partial product is added in float32
outside the tensor cores, as in ``fp8_gemm``'s kernel (Hopper's fp8 accumulator keeps about
14 bits, DeepSeek-V3 measured); blockwise scales multiply each partial, tensorwise and rowwise
ones (per expert) the sum once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING

__all__ = ["gemm_k"]

# BLOCK_T is the blockwise tile's 128 tokens: each step over K is one scale tile. The
# interpreter computes fp8 tl.dot wrongly like bfloat16, so there operands go to float32.
_BLOCK_M, _BLOCK_N, _BLOCK_T = 64, 128, 128


@triton.jit
def _fp8_gemm_k_kernel(
    A, B, A_SCALE, B_SCALE, GROUP_SIZES, ENDS, FIRST_TILES, OUT, M, N,
    stride_at, stride_am, stride_bt, stride_bn,
    stride_asr, stride_asc, stride_bsr, stride_bsc,
    A_SCALE_COLS: tl.constexpr, B_SCALE_COLS: tl.constexpr, PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    expert = tl.program_id(0)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = ms < M, ns < N
    end = tl.load(ENDS + expert).to(tl.int32)
    start = end - tl.load(GROUP_SIZES + expert).to(tl.int32)
    # A scale's row: the expert's (tensorwise, rowwise) or its current tile's (blockwise).
    a_scales = A_SCALE + (ms // A_SCALE_COLS) * stride_asc
    b_scales = B_SCALE + (ns // B_SCALE_COLS) * stride_bsc
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for t0 in range(start, end, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        t_ok = ts < end
        a = tl.load(
            A + ts[None, :].to(tl.int64) * stride_at + ms[:, None] * stride_am,
            mask=m_ok[:, None] & t_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            B + ts[:, None].to(tl.int64) * stride_bt + ns[None, :] * stride_bn,
            mask=t_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        partial = tl.dot(a, b, input_precision="ieee" if UPCAST else "tf32")
        if PER_TILE:
            tile = (tl.load(FIRST_TILES + expert) + (t0 - start) // BLOCK_T).to(tl.int64)
            a_scale = tl.load(a_scales + tile * stride_asr, mask=m_ok, other=0.0)
            b_scale = tl.load(b_scales + tile * stride_bsr, mask=n_ok, other=0.0)
            acc += partial * a_scale[:, None] * b_scale[None, :]
        else:
            acc += partial
    if not PER_TILE:
        a_scale = tl.load(a_scales + expert * stride_asr, mask=m_ok, other=0.0)
        b_scale = tl.load(b_scales + expert * stride_bsr, mask=n_ok, other=0.0)
        acc = acc * a_scale[:, None] * b_scale[None, :]
    out = OUT + expert.to(tl.int64) * M * N + ms[:, None] * N + ns[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemm_k(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    group_sizes: torch.Tensor,
    first_tiles: torch.Tensor,
    recipe: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[E, M, N]``: ``a [T, M]`` and ``b [T, N]`` contracted over each expert's rows; the
    scales 2-d (a row per expert or per tile), as ``d9d.kernels.fp8_grouped_gemm_k`` passes
    them."""
    (_, m), (_, n), experts = a.shape, b.shape, group_sizes.shape[0]
    group_sizes = group_sizes.contiguous()  # read as a dense array, like grouped_gemm's
    out = torch.empty(experts, m, n, dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    blockwise = recipe == "blockwise"
    grid = (experts, triton.cdiv(m, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    _fp8_gemm_k_kernel[grid](
        a, b, a_scale, b_scale, group_sizes, group_sizes.cumsum(0), first_tiles, out, m, n,
        *a.stride(), *b.stride(), *a_scale.stride(), *b_scale.stride(),
        A_SCALE_COLS=128 if blockwise and a_scale.shape[1] != m else 1,
        B_SCALE_COLS=128 if blockwise and b_scale.shape[1] != n else 1,
        PER_TILE=blockwise, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_T=_BLOCK_T,
        UPCAST=INTERPRETING,
    )  # fmt: skip
    return out
