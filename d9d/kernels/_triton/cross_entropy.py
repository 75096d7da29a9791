"""Cross-entropy over a vocab in Triton: online softmax, never a float32 copy of the logits.

A program owns a tile of rows (one row on a GPU) and sweeps the vocab in blocks, keeping a
running max and sum of exponentials in float32 registers, so it reads the logits once in
their own dtype. The gradient ``softmax - one_hot`` (zero on ignored rows) is written by a
second sweep: into a new buffer by :func:`backward`, or over the logits themselves by
:func:`loss_and_grad_`, which the fused linear cross-entropy uses to keep one chunk alive.
A label outside ``[0, vocab)`` that is not ``ignore_index`` gives a NaN loss, not a crash.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, num_warps, row_max, row_sum, tile_rows

__all__ = ["backward", "forward", "loss_and_grad_"]

_MAX_BLOCK = 1024 if INTERPRETING else 4096


@triton.jit
def _logsumexp(LOGITS, rows, row_mask, stride, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    running_sum = tl.full([ROWS], 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        col_mask = cols < n_cols
        x = tl.load(
            LOGITS + rows[:, None] * stride + cols[None, :],
            mask=row_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        x = tl.where(col_mask[None, :], x, float("-inf"))
        new_max = tl.maximum(running_max, row_max(x, axis=1))
        # While every logit so far is -inf, shift by 0: -inf - -inf would be NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - shift) + row_sum(
            tl.exp(x - shift[:, None]), axis=1
        )
        running_max = new_max
    return running_max + tl.log(running_sum)


@triton.jit
def _write_grad(
    SRC,
    DST,
    rows,
    row_mask,
    src_stride,
    dst_stride,
    labels,
    valid,
    lse,
    scale,
    n_cols,
    BLOCK: tl.constexpr,
):
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(SRC + rows[:, None] * src_stride + cols[None, :], mask=mask, other=0.0)
        grad = tl.exp(x.to(tl.float32) - lse[:, None])
        grad = tl.where(cols[None, :] == labels[:, None], grad - 1.0, grad)
        grad = tl.where(valid[:, None], grad * scale, 0.0)
        tl.store(
            DST + rows[:, None] * dst_stride + cols[None, :],
            grad.to(DST.dtype.element_ty),
            mask=mask,
        )


@triton.jit
def _forward_kernel(
    LOGITS,
    LABELS,
    LOSS,
    LSE,
    n_rows,
    n_cols,
    stride,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    labels = tl.load(LABELS + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    lse = _logsumexp(LOGITS, rows, row_mask, stride, n_cols, ROWS, BLOCK)
    valid = labels != ignore_index
    in_range = (labels >= 0) & (labels < n_cols)
    target = tl.load(
        LOGITS + rows * stride + labels, mask=row_mask & valid & in_range, other=0.0
    ).to(tl.float32)
    loss = tl.where(valid, tl.where(in_range, lse - target, float("nan")), 0.0)
    tl.store(LOSS + rows, loss, mask=row_mask)
    if WRITE_GRAD:
        _write_grad(
            LOGITS, LOGITS, rows, row_mask, stride, stride, labels, valid, lse, 1.0, n_cols, BLOCK
        )
    else:
        tl.store(LSE + rows, lse, mask=row_mask)


@triton.jit
def _backward_kernel(
    LOGITS,
    LABELS,
    LSE,
    GRAD,
    SCALE,
    n_rows,
    n_cols,
    stride,
    grad_stride,
    ignore_index,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    labels = tl.load(LABELS + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    lse = tl.load(LSE + rows, mask=row_mask, other=0.0)
    scale = tl.load(SCALE)
    _write_grad(
        LOGITS,
        GRAD,
        rows,
        row_mask,
        stride,
        grad_stride,
        labels,
        labels != ignore_index,
        lse,
        scale,
        n_cols,
        BLOCK,
    )


def _rows_major(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def _launch_shape(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """``(programs, ROWS, BLOCK)``."""
    block = min(triton.next_power_of_2(n_cols), _MAX_BLOCK)
    rows = tile_rows(block, n_rows)
    return triton.cdiv(n_rows, rows), rows, block


def _forward(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, write_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, n_cols = logits.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(0 if write_grad else n_rows, dtype=torch.float32, device=logits.device)
    if n_rows > 0:
        programs, rows, block = _launch_shape(n_rows, n_cols)
        _forward_kernel[(programs,)](
            logits,
            labels.contiguous(),
            loss,
            lse,
            n_rows,
            n_cols,
            logits.stride(0),
            ignore_index,
            WRITE_GRAD=write_grad,
            ROWS=rows,
            BLOCK=block,
            num_warps=num_warps(rows * block),
        )
    return loss, lse


def forward(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(loss, logsumexp)``, float32 ``[N]``, of ``[N, V]`` logits (0 if ignored)."""
    return _forward(_rows_major(logits), labels, ignore_index, write_grad=False)


def loss_and_grad_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Per-row float32 loss of contiguous ``[N, V]`` logits, overwritten by ``softmax - one_hot``."""
    return _forward(logits, labels, ignore_index, write_grad=True)[0]


def backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    """``(softmax - one_hot) * scale`` (0 on ignored rows), in a new buffer of logits' dtype."""
    logits = _rows_major(logits)
    n_rows, n_cols = logits.shape
    grad = torch.empty(n_rows, n_cols, dtype=logits.dtype, device=logits.device)
    if n_rows > 0:
        programs, rows, block = _launch_shape(n_rows, n_cols)
        _backward_kernel[(programs,)](
            logits,
            labels.contiguous(),
            lse,
            grad,
            scale.to(torch.float32).contiguous(),
            n_rows,
            n_cols,
            logits.stride(0),
            grad.stride(0),
            ignore_index,
            ROWS=rows,
            BLOCK=block,
            num_warps=num_warps(rows * block),
        )
    return grad
