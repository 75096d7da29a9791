"""Rotary embedding (rotate-half convention) of q and k in one Triton launch.

q ``[B, S, Hq, D]`` and k ``[B, S, Hk, D]`` are seen as rows of ``D`` (one per token and
head); the first programs rotate tiles of q rows, the rest tiles of k rows, each reading the
``cos``/``sin`` row of its token. The backward is the same kernel rotating the other way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import num_warps, tile_rows

__all__ = ["rotate"]


@triton.jit
def _rotate_tile(
    X,
    OUT,
    COS,
    SIN,
    tile,
    n_rows,
    n_heads,
    seq_len,
    cos_stride_b,
    cos_stride_s,
    sin_stride_b,
    sin_stride_s,
    half,
    BACKWARD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tile.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (d < half)[None, :]
    token = rows // n_heads
    batch, pos = token // seq_len, token % seq_len
    cos_at = COS + (batch * cos_stride_b + pos * cos_stride_s)[:, None] + d[None, :]
    sin_at = SIN + (batch * sin_stride_b + pos * sin_stride_s)[:, None] + d[None, :]
    cos1 = tl.load(cos_at, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_at + half, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_at, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_at + half, mask=mask, other=0.0).to(tl.float32)
    offsets = rows[:, None] * (2 * half) + d[None, :]
    x1 = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + offsets + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the forward rotation
        out1 = x1 * cos1 + x2 * sin2
        out2 = x2 * cos2 - x1 * sin1
    else:
        out1 = x1 * cos1 - x2 * sin1
        out2 = x2 * cos2 + x1 * sin2
    tl.store(OUT + offsets, out1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + offsets + half, out2.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _kernel(
    Q,
    K,
    Q_OUT,
    K_OUT,
    COS,
    SIN,
    q_tiles,
    q_rows,
    k_rows,
    q_heads,
    k_heads,
    seq_len,
    cos_stride_b,
    cos_stride_s,
    sin_stride_b,
    sin_stride_s,
    half,
    BACKWARD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < q_tiles:
        _rotate_tile(
            Q, Q_OUT, COS, SIN, pid, q_rows, q_heads, seq_len, cos_stride_b, cos_stride_s,
            sin_stride_b, sin_stride_s, half, BACKWARD, ROWS, BLOCK,
        )  # fmt: skip
    else:
        _rotate_tile(
            K, K_OUT, COS, SIN, pid - q_tiles, k_rows, k_heads, seq_len, cos_stride_b,
            cos_stride_s, sin_stride_b, sin_stride_s, half, BACKWARD, ROWS, BLOCK,
        )  # fmt: skip


def _strides(table: torch.Tensor) -> tuple[int, int]:
    """(batch, position) strides of a ``[S, D]`` or ``[B, S, D]`` cos/sin table."""
    if table.dim() == 2 or table.shape[0] == 1:
        return 0, table.stride(-2)
    return table.stride(0), table.stride(1)


def rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by the angles of cos/sin (by minus them if ``backward``)."""
    q, k = q.contiguous(), k.contiguous()
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    batch, seq_len, q_heads, head_dim = q.shape
    k_heads = k.shape[2]
    q_rows, k_rows = batch * seq_len * q_heads, batch * seq_len * k_heads
    if q_rows + k_rows == 0 or head_dim == 0:  # no element to rotate
        return q_out, k_out
    half = head_dim // 2
    block = triton.next_power_of_2(half)
    rows = tile_rows(block, max(q_rows, k_rows))
    q_tiles, k_tiles = triton.cdiv(q_rows, rows), triton.cdiv(k_rows, rows)
    _kernel[(q_tiles + k_tiles,)](
        q,
        k,
        q_out,
        k_out,
        cos,
        sin,
        q_tiles,
        q_rows,
        k_rows,
        q_heads,
        k_heads,
        seq_len,
        *_strides(cos),
        *_strides(sin),
        half,
        BACKWARD=backward,
        ROWS=rows,
        BLOCK=block,
        num_warps=num_warps(rows * block),
    )
    return q_out, k_out
