"""SwiGLU (``silu(gate) * up``) forward and backward in Triton: flat elementwise kernels.

The forward reads ``gate`` and ``up`` and writes the output once (3 tensors of traffic); the
backward reads ``grad, gate, up`` and writes both gradients (5), recomputing the sigmoid
instead of saving it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, num_warps

__all__ = ["backward", "forward"]

_BLOCK = 65536 if INTERPRETING else 1024


@triton.jit
def _forward_kernel(GATE, UP, OUT, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    gate = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(OUT + offsets, (silu * up).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(GRAD, GATE, UP, DGATE, DUP, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    grad = tl.load(GRAD + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = gate * sig
    tl.store(DUP + offsets, (grad * silu).to(DUP.dtype.element_ty), mask=mask)
    dgate = grad * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(DGATE + offsets, dgate.to(DGATE.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate``'s shape and dtype (a contiguous tensor)."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    if gate.numel() > 0:
        _forward_kernel[_grid(gate.numel())](
            gate, up, out, gate.numel(), BLOCK=_BLOCK, num_warps=num_warps(_BLOCK)
        )
    return out


def backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d gate, d up)``, contiguous, of ``gate``'s shape and dtype."""
    grad, gate, up = grad.contiguous(), gate.contiguous(), up.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    if gate.numel() > 0:
        _backward_kernel[_grid(gate.numel())](
            grad, gate, up, dgate, dup, gate.numel(), BLOCK=_BLOCK, num_warps=num_warps(_BLOCK)
        )
    return dgate, dup
