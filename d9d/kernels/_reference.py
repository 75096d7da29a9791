"""Pure-PyTorch references of every ``d9d.kernels`` op: the ground truth backends are tested on.

Each computes in float32 and casts its outputs to the input dtype once, so a low-precision
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight``, in float32, cast to ``x.dtype``."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; the sum is rounded to ``x.dtype`` first."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, in float32, cast to ``gate.dtype``."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, rotate-half convention; q/k ``[B, S, H, D]``, cos/sin ``[(B,) S, D]``.

    ``cos`` and ``sin`` are constants: they get no gradient.
    """
    cos = cos.detach().float().unsqueeze(-2)  # [(B,) S, 1, D], broadcast over heads
    sin = sin.detach().float().unsqueeze(-2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)

    return rotate(q), rotate(k)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Mean over tokens whose label is not ``ignore_index``; a 0-d float32 tensor."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
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
    """One AdamW update (decoupled weight decay, bias-corrected), in place, in float32."""
    lr, step = lr.float(), step.float()
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = torch.sqrt(1 - beta2**step)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        g32 = g.float()
        m32 = m.float() * beta1 + g32 * (1 - beta1)
        v32 = v.float() * beta2 + g32.square() * (1 - beta2)
        p32 = p.float() * (1 - lr * weight_decay)
        p32 = p32 - step_size * m32 / (v32.sqrt() / bias_correction2_sqrt + eps)
        p.copy_(p32)
        m.copy_(m32)
        v.copy_(v32)
