"""Row movement of ``moe_permute``/``moe_unpermute`` in Triton; the routing indices come in.

``row_map [T, k]`` says where each token's ``j``-th choice sits in the permuted rows. Three
kernels, each a program per tile of tokens and columns, none with atomics:

- ``scatter``: ``dst[row_map[t, j]] = w[t, j] * src[t]`` (permute forward with ``w = 1``, and
  the expert-output gradient of unpermute);
- ``gather_sum``: ``dst[t] = sum_j w[t, j] * src[row_map[t, j]]`` (unpermute forward, and the
  permute gradient with ``w = 1``), accumulated in float32;
- ``choice_dot``: ``dw[t, j] = <grad[t], y[row_map[t, j]]>`` (the routing-weight gradient).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, row_sum

__all__ = ["choice_dot", "gather_sum", "scatter"]

_BLOCK_T, _MAX_BLOCK_H = (64, 1024) if INTERPRETING else (4, 1024)


@triton.jit
def _scatter_kernel(
    SRC, ROW_MAP, W, DST, T, H, TOP_K,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, WEIGHTED: tl.constexpr,
):  # fmt: skip
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token_ok = tokens < T
    mask = token_ok[:, None] & (cols < H)[None, :]
    src = tl.load(SRC + tokens[:, None].to(tl.int64) * H + cols[None, :], mask=mask, other=0.0)
    for j in range(TOP_K):
        choice = tokens.to(tl.int64) * TOP_K + j
        rows = tl.load(ROW_MAP + choice, mask=token_ok, other=0)
        value = src.to(tl.float32)
        if WEIGHTED:
            value = value * tl.load(W + choice, mask=token_ok, other=0.0).to(tl.float32)[:, None]
        dst = DST + rows[:, None].to(tl.int64) * H + cols[None, :]
        tl.store(dst, value.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _gather_sum_kernel(
    SRC, ROW_MAP, W, DST, T, H, TOP_K,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, WEIGHTED: tl.constexpr,
):  # fmt: skip
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token_ok = tokens < T
    mask = token_ok[:, None] & (cols < H)[None, :]
    acc = tl.full((BLOCK_T, BLOCK_H), 0.0, tl.float32)
    for j in range(TOP_K):
        choice = tokens.to(tl.int64) * TOP_K + j
        rows = tl.load(ROW_MAP + choice, mask=token_ok, other=0)
        src = SRC + rows[:, None].to(tl.int64) * H + cols[None, :]
        value = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            value = value * tl.load(W + choice, mask=token_ok, other=0.0).to(tl.float32)[:, None]
        acc += value
    dst = DST + tokens[:, None].to(tl.int64) * H + cols[None, :]
    tl.store(dst, acc.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _choice_dot_kernel(
    GRAD, Y, ROW_MAP, DW, T, H, TOP_K, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < T
    for j in range(TOP_K):
        choice = tokens.to(tl.int64) * TOP_K + j
        rows = tl.load(ROW_MAP + choice, mask=token_ok, other=0)
        acc = tl.full((BLOCK_T,), 0.0, tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = token_ok[:, None] & (cols < H)[None, :]
            # other=0.0: a masked lane without one is undefined on a GPU (the interpreter
            # happens to read 0), and the columns past H of a power-of-two tile enter the sum.
            grad_ptrs = GRAD + tokens[:, None].to(tl.int64) * H + cols[None, :]
            grad = tl.load(grad_ptrs, mask=mask, other=0.0)
            y = tl.load(Y + rows[:, None].to(tl.int64) * H + cols[None, :], mask=mask, other=0.0)
            acc += row_sum(grad.to(tl.float32) * y.to(tl.float32), axis=1)
        tl.store(DW + choice, acc.to(DW.dtype.element_ty), mask=token_ok)


def _launch(kernel, src, row_map, weights, dst) -> torch.Tensor:
    tokens, top_k = row_map.shape
    hidden = src.shape[1]
    if dst.numel() > 0:
        block_h = min(_MAX_BLOCK_H, triton.next_power_of_2(hidden))
        grid = (triton.cdiv(tokens, _BLOCK_T), triton.cdiv(hidden, block_h))
        weighted = weights is not None
        kernel[grid](
            src, row_map, weights if weighted else row_map, dst, tokens, hidden, top_k,
            BLOCK_T=_BLOCK_T, BLOCK_H=block_h, WEIGHTED=weighted,
        )  # fmt: skip
    return dst


def scatter(x: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``[T*k, H]``: row ``row_map[t, j]`` is ``weights[t, j] * x[t]`` (``x`` if no weights)."""
    x, row_map = x.contiguous(), row_map.contiguous()
    weights = None if weights is None else weights.contiguous()
    dst = x.new_empty(row_map.numel(), x.shape[1])
    return _launch(_scatter_kernel, x, row_map, weights, dst)


def gather_sum(
    y: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """``[T, H]``: row ``t`` is ``sum_j weights[t, j] * y[row_map[t, j]]`` (weights 1 if None)."""
    y, row_map = y.contiguous(), row_map.contiguous()
    weights = None if weights is None else weights.contiguous()
    dst = y.new_empty(row_map.shape[0], y.shape[1])
    return _launch(_gather_sum_kernel, y, row_map, weights, dst)


def choice_dot(
    grad: torch.Tensor, y: torch.Tensor, row_map: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[T, k]`` of ``dtype``: ``<grad[t], y[row_map[t, j]]>``, summed in float32."""
    grad, y, row_map = grad.contiguous(), y.contiguous(), row_map.contiguous()
    (tokens, top_k), hidden = row_map.shape, y.shape[1]
    dw = torch.empty(tokens, top_k, dtype=dtype, device=y.device)
    if dw.numel() > 0:
        block_h = min(_MAX_BLOCK_H, triton.next_power_of_2(max(hidden, 1)))
        _choice_dot_kernel[(triton.cdiv(tokens, _BLOCK_T),)](
            grad, y, row_map, dw, tokens, hidden, top_k, BLOCK_T=_BLOCK_T, BLOCK_H=block_h
        )
    return dw
