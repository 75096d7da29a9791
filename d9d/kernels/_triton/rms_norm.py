"""RMSNorm (optionally fused with the residual add) forward and backward in Triton.

A program normalizes a tile of rows (one row for hidden sizes >= 2048), each held whole in
registers (hidden sizes up to 65536), reading ``x`` once and writing ``y`` once, so the
forward moves the minimum bytes. The backward runs a few programs per SM, each looping over
a contiguous band of tiles and accumulating its share of the weight gradient in float32
registers; the host sums the per-program partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import num_warps, persistent_programs, row_sum, tile_rows

__all__ = ["backward", "forward"]


@triton.jit
def _forward_kernel(
    X,
    RES,
    W,
    Y,
    RES_OUT,
    RSTD,
    n_rows,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offsets = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(RES + offsets, mask=mask, other=0.0).to(tl.float32)
        x_stored = x.to(RES_OUT.dtype.element_ty)  # normalize the sum as it is stored
        tl.store(RES_OUT + offsets, x_stored, mask=mask)
        x = x_stored.to(tl.float32)
    rstd = tl.rsqrt(row_sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(Y + offsets, (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def _backward_kernel(
    DY,
    X,
    W,
    RSTD,
    DRES,
    DX,
    DW_PARTIAL,
    n_rows,
    n_cols,
    tiles_per_program,
    HAS_DRES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    dw = tl.full([BLOCK], 0.0, tl.float32)
    for tile in range(0, tiles_per_program):
        rows = (pid * tiles_per_program + tile) * ROWS + tl.arange(0, ROWS)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        offsets = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
        x_hat = x * rstd[:, None]
        w_dy = w[None, :] * dy
        dx = (w_dy - x_hat * (row_sum(x_hat * w_dy, axis=1) / n_cols)[:, None]) * rstd[:, None]
        if HAS_DRES:
            dx += tl.load(DRES + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += row_sum(dy * x_hat, axis=0)
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=cols < n_cols)


def forward(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(y, x + residual or None, rstd)`` with ``rstd`` float32 of shape ``x.shape[:-1]``."""
    n_rows, n_cols = x.shape[:-1].numel(), x.shape[-1]  # not reshape(-1, 0): ambiguous
    x2 = x.reshape(n_rows, n_cols).contiguous()
    y = torch.empty_like(x2)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    res2 = residual.reshape(n_rows, n_cols).contiguous() if residual is not None else None
    res_out = torch.empty_like(x2) if residual is not None else None
    if n_rows == 0 or n_cols == 0:  # nothing to normalize
        rstd.fill_(float("nan"))  # rsqrt of the mean of no element, as the reference's
    else:
        block = triton.next_power_of_2(n_cols)
        rows = tile_rows(block, n_rows)
        _forward_kernel[(triton.cdiv(n_rows, rows),)](
            x2,
            res2,
            weight.contiguous(),
            y,
            res_out,
            rstd,
            n_rows,
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            ROWS=rows,
            BLOCK=block,
            # At most 8: at hidden 14336 (H100, bfloat16) 8 warps ran 7% faster than 16.
            num_warps=min(8, num_warps(rows * block)),
        )
    res_out = res_out.view(x.shape) if res_out is not None else None
    return y.view(x.shape), res_out, rstd.view(x.shape[:-1])


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dres: torch.Tensor | None,
    need_dweight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)``; ``dx`` includes ``dres`` when given; ``dweight`` empty if not needed."""
    n_rows, n_cols = x.shape[:-1].numel(), x.shape[-1]
    x2 = x.reshape(n_rows, n_cols).contiguous()
    dx = torch.empty_like(x2)
    if n_cols == 0:  # no element: dx empty, dweight [0]
        return dx.view(x.shape), weight.new_empty(0)
    block = triton.next_power_of_2(n_cols)
    rows = tile_rows(block, n_rows)
    programs, tiles_per_program = persistent_programs(x.device, max(1, triton.cdiv(n_rows, rows)))
    partial = torch.zeros(programs, n_cols, dtype=torch.float32, device=x.device)
    if n_rows > 0:
        _backward_kernel[(programs,)](
            dy.reshape(n_rows, n_cols).contiguous(),
            x2,
            weight.contiguous(),
            rstd.reshape(-1).contiguous(),
            dres.reshape(n_rows, n_cols).contiguous() if dres is not None else None,
            dx,
            partial,
            n_rows,
            n_cols,
            tiles_per_program,
            HAS_DRES=dres is not None,
            ROWS=rows,
            BLOCK=block,
            num_warps=num_warps(rows * block),
        )
    dweight = partial.sum(0).to(weight.dtype) if need_dweight else weight.new_empty(0)
    return dx.view(x.shape), dweight
