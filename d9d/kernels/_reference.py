"""Pure-PyTorch references of every ``d9d.kernels`` op: the ground truth backends are tested on.

Each computes in float32 (float64 stays float64) and casts its outputs to the input dtype once, so a low-precision
backend that also accumulates in float32 agrees with it to about one unit in the last place.
They run anywhere, are traced by ``torch.compile`` as ordinary torch code, and get their
gradients from autograd. None of them is memory-frugal: ``cross_entropy`` makes a float32
copy of the logits and ``fused_linear_cross_entropy`` materializes all of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "adamw",
    "cross_entropy",
    "fused_add_rms_norm",
    "fused_linear_cross_entropy",
    "rms_norm",
    "rope",
    "swiglu",
]


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or in its own dtype if wider."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight``, in float32, cast to ``x.dtype``."""
    wide = _wide(x)
    normed = wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + eps)
    return (normed * _wide(weight)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; the sum is rounded to ``x.dtype`` first."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, in float32, cast to ``gate.dtype``."""
    return (F.silu(_wide(gate)) * _wide(up)).to(gate.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, rotate-half convention; q/k ``[B, S, H, D]``, cos/sin ``[(B,) S, D]``.

    ``cos`` and ``sin`` are constants: they get no gradient.
    """
    cos = _wide(cos.detach()).unsqueeze(-2)  # [(B,) S, 1, D], broadcast over heads
    sin = _wide(sin.detach()).unsqueeze(-2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        wide = _wide(x)
        return (wide * cos + _rotate_half(wide) * sin).to(x.dtype)

    return rotate(q), rotate(k)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Mean over tokens whose label is not ``ignore_index``; 0-d, float32 (float64 if so)."""
    return F.cross_entropy(
        _wide(logits.reshape(-1, logits.shape[-1])),
        labels.reshape(-1).long(),
        ignore_index=ignore_index,
    )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    chunk_size: int,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, labels)``, materializing every logit at once."""
    return cross_entropy(hidden @ weight.T, labels, ignore_index)


@torch.no_grad()
def adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    lr: torch.Tensor,
    step: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update (decoupled weight decay, bias-corrected), in place, in float32.

    The scalar factors are computed in float64 (as ``torch.optim.AdamW`` computes them in
    Python floats), then applied as 0-d tensors, which do not widen the float32 math.
    """
    lr, step = lr.to(torch.float64), step.to(torch.float64)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = torch.sqrt(1 - beta2**step)
    decay = 1 - lr * weight_decay
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        g_wide = _wide(g)
        m_wide = _wide(m) * beta1 + g_wide * (1 - beta1)
        v_wide = _wide(v) * beta2 + g_wide.square() * (1 - beta2)
        p_wide = _wide(p) * decay
        p_wide = p_wide - step_size * m_wide / (v_wide.sqrt() / bias_correction2_sqrt + eps)
        p.copy_(p_wide)
        m.copy_(m_wide)
        v.copy_(v_wide)
