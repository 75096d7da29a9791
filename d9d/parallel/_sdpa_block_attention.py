"""Block attention on PyTorch's fused SDPA kernel that returns the log-sum-exp (CPU).

``aten._scaled_dot_product_flash_attention_for_cpu`` returns the output and the log-sum-exp of
each query row, and its backward takes the *final* output and log-sum-exp, which is the
contract of :class:`~d9d.parallel._block_attention.BlockAttention`: the fused kernel never
materializes the ``[Sq, Sk]`` scores, unlike the math version. Grouped-query attention repeats
K/V heads for the kernel and sums their grads back; the kernel wants one head size for Q, K
and V, so the smaller of the two is zero-padded (zeros change neither the scores, whose scale
is explicit, nor the output's real columns) and sliced off again. The CUDA kernels with a log-sum-exp
(flash, memory-efficient) have other signatures and are not wired here yet.
"""

from __future__ import annotations

import torch

from ._block_attention import BlockAttention, compute_dtype

__all__ = ["SDPA_BLOCK_ATTENTION", "sdpa_unavailable"]

_aten = torch.ops.aten


def sdpa_unavailable(device_type: str | None) -> str | None:
    """Why the SDPA block attention cannot run on ``device_type`` (None: it can)."""
    if device_type in (None, "cpu"):
        return None
    return f"its fused kernel runs on CPU only; {device_type} uses the math version"


def _repeat(kv: torch.Tensor, group: int) -> torch.Tensor:
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def _pad(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else torch.nn.functional.pad(x, (0, size - x.shape[-1]))


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[1] // k.shape[1]
    size = max(q.shape[-1], v.shape[-1])
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        _pad(q, size),
        _pad(_repeat(k, group), size),
        _pad(_repeat(v, group), size),
        0.0,
        causal,
        scale=scale,
    )
    dtype = compute_dtype(q.dtype)
    return out[..., : v.shape[-1]].to(dtype), lse.to(dtype)


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, kv_heads = k.shape[:2]
    group = q.shape[1] // kv_heads
    head, v_head = q.shape[-1], v.shape[-1]
    size = max(head, v_head)
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _pad(dout.to(q.dtype), size),
        _pad(q, size),
        _pad(_repeat(k, group), size),
        _pad(_repeat(v, group), size),
        _pad(out.to(q.dtype), size),
        lse.to(torch.promote_types(q.dtype, torch.float32)),
        0.0,
        causal,
        scale=scale,
    )
    dtype = compute_dtype(q.dtype)
    dk = dk[..., :head].reshape(batch, kv_heads, group, *dk.shape[2:-1], head).sum(2)
    dv = dv[..., :v_head].reshape(batch, kv_heads, group, *dv.shape[2:-1], v_head).sum(2)
    return dq[..., :head].to(dtype), dk.to(dtype), dv.to(dtype)


SDPA_BLOCK_ATTENTION = BlockAttention("sdpa", _forward, _backward)
"""Block attention on the fused CPU SDPA kernel with log-sum-exp (see the module docstring)."""
