"""One fused AdamW update per tensor in Triton: read p, g, m, v once, write p, m, v once.

``lr`` and the bias corrections are read from 0-d device tensors, so a schedule's value
changes without a recompile or a host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INTERPRETING, num_warps

__all__ = ["update_"]

_BLOCK = 65536 if INTERPRETING else 1024


@triton.jit
def _kernel(
    P,
    G,
    M,
    V,
    LR,
    STEP_SIZE,
    BIAS_CORRECTION2_SQRT,
    n,
    beta1,
    beta2,
    eps,
    weight_decay,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    lr = tl.load(LR)
    step_size = tl.load(STEP_SIZE)
    bias_correction2_sqrt = tl.load(BIAS_CORRECTION2_SQRT)
    p = tl.load(P + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + offsets, mask=mask, other=0.0).to(tl.float32)
    m = m * beta1 + g * (1.0 - beta1)
    v = v * beta2 + g * g * (1.0 - beta2)
    p = p * (1.0 - lr * weight_decay)
    p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(P + offsets, p.to(P.dtype.element_ty), mask=mask)
    tl.store(M + offsets, m.to(M.dtype.element_ty), mask=mask)
    tl.store(V + offsets, v.to(V.dtype.element_ty), mask=mask)


def update_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    lr: torch.Tensor,
    step: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """Updates ``params``, ``exp_avgs`` and ``exp_avg_sqs`` in place (via copies if strided)."""
    if not params:
        return
    device = params[0].device
    lr = lr.to(device=device, dtype=torch.float32).reshape(())
    step = step.to(device=device, dtype=torch.float32)
    step_size = (lr / (1 - beta1**step)).reshape(())
    bias_correction2_sqrt = torch.sqrt(1 - beta2**step).reshape(())
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if p.numel() == 0:
            continue
        p_, m_, v_ = (t if t.is_contiguous() else t.contiguous() for t in (p, m, v))
        _kernel[(triton.cdiv(p.numel(), _BLOCK),)](
            p_,
            g.contiguous(),
            m_,
            v_,
            lr,
            step_size,
            bias_correction2_sqrt,
            p.numel(),
            beta1,
            beta2,
            eps,
            weight_decay,
            BLOCK=_BLOCK,
            num_warps=num_warps(_BLOCK),
        )
        for target, result in ((p, p_), (m, m_), (v, v_)):
            if result is not target:
                target.copy_(result)
