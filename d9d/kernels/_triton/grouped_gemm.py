"""Grouped GEMM in Triton: ``out[rows of expert e] = x[rows of e] @ w[e]``, with no host sync.

The forward (and the input gradient, the same kernel on ``w`` transposed) launches
``cdiv(T, BLOCK_M) + E`` row tiles, an upper bound on ``sum_e cdiv(size_e, BLOCK_M)`` that
needs only shapes; each program scans ``group_sizes`` on the device to find its expert and
rows, and programs past the last tile do nothing. The weight gradient runs one program per
``(expert, K tile, N tile)`` looping over that expert's rows. Tile sizes are not tuned yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING

__all__ = ["gemm", "weight_grad"]

# The interpreter cannot compute a bfloat16 tl.dot correctly: there both operands go to
# float32 (UPCAST). Bigger tiles there, since each program costs milliseconds.
_BLOCK_M, _BLOCK_N, _BLOCK_K = (64, 64, 64) if INTERPRETING else (64, 128, 64)


@triton.jit
def _find_tile(GROUP_SIZES, pid, E, BLOCK_M: tl.constexpr):
    """``(expert, first row, end row)`` of row tile ``pid``; expert -1 past the last tile."""
    expert = tl.full((), -1, tl.int32)
    start = tl.full((), 0, tl.int32)
    end = tl.full((), 0, tl.int32)
    tiles_before = tl.full((), 0, tl.int32)
    rows_before = tl.full((), 0, tl.int32)
    for e in range(E):
        size = tl.load(GROUP_SIZES + e).to(tl.int32)
        tiles = (size + BLOCK_M - 1) // BLOCK_M
        hit = (pid >= tiles_before) & (pid < tiles_before + tiles)
        expert = tl.where(hit, e, expert)
        start = tl.where(hit, rows_before + (pid - tiles_before) * BLOCK_M, start)
        end = tl.where(hit, rows_before + size, end)
        tiles_before += tiles
        rows_before += size
    return expert, start, end


@triton.jit
def _gemm_kernel(
    X, W, GROUP_SIZES, OUT, E, K, N,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    expert, start, end = _find_tile(GROUP_SIZES, tl.program_id(0), E, BLOCK_M)
    if expert >= 0:
        rows = start + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < end, cols < N
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(
                X + rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk,
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                W + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk
                + cols[None, :] * stride_wn,
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )  # fmt: skip
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        out = OUT + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _weight_grad_kernel(
    X, DY, GROUP_SIZES, ENDS, DW, K, N,
    stride_xm, stride_xk, stride_dym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    expert = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok, col_ok = ks < K, cols < N
    end = tl.load(ENDS + expert).to(tl.int32)
    start = end - tl.load(GROUP_SIZES + expert).to(tl.int32)
    acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        a = tl.load(
            X + rows[None, :].to(tl.int64) * stride_xm + ks[:, None] * stride_xk,
            mask=k_ok[:, None] & row_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            DY + rows[:, None].to(tl.int64) * stride_dym + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    dw = DW + expert.to(tl.int64) * K * N + ks[:, None] * N + cols[None, :]
    tl.store(dw, acc.to(DW.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


def _precision(dtype: torch.dtype) -> str:
    """float32 operands multiply in full precision (as the reference's matmul), not TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def gemm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``[T, N]`` in ``x``'s dtype; ``w`` ``[E, K, N]`` may be any strided view (a transpose)."""
    # group_sizes too: the kernels read it as a dense array (a strided view read that way
    # gave wrong rows, and sizes past its end wrote out of bounds).
    x, group_sizes = x.contiguous(), group_sizes.contiguous()
    (rows, k), (experts, _, n) = x.shape, w.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows > 0 and n > 0:
        grid = (triton.cdiv(rows, _BLOCK_M) + experts, triton.cdiv(n, _BLOCK_N))
        _gemm_kernel[grid](
            x, w, group_sizes, out, experts, k, n, *x.stride(), *w.stride(),
            BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
            UPCAST=INTERPRETING, PRECISION=_precision(x.dtype),
        )  # fmt: skip
    return out


def weight_grad(x: torch.Tensor, dy: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``[E, K, N]``: ``x[rows of e].T @ dy[rows of e]`` per expert (zero for empty ones)."""
    x, dy, group_sizes = x.contiguous(), dy.contiguous(), group_sizes.contiguous()
    (_, k), (_, n), experts = x.shape, dy.shape, group_sizes.shape[0]
    dw = torch.empty(experts, k, n, dtype=x.dtype, device=x.device)
    if dw.numel() > 0:
        ends = group_sizes.cumsum(0)
        grid = (experts, triton.cdiv(k, _BLOCK_K), triton.cdiv(n, _BLOCK_N))
        _weight_grad_kernel[grid](
            x, dy, group_sizes, ends, dw, k, n, *x.stride(), dy.stride(0),
            BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
            UPCAST=INTERPRETING, PRECISION=_precision(x.dtype),
        )  # fmt: skip
    return dw
