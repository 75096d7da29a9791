"""The math of a Llama block as plain functions: RMSNorm, RoPE, SwiGLU, causal GQA attention.

Modules in ``_model.py`` only hold weights and call these, so that the kernel registry can
later swap any of them for a fused backend without touching the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._gather import active_split

__all__ = ["attention", "rms_norm", "rope", "rope_cos_sin", "rope_inv_freq", "swiglu"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, computed in at least fp32, cast back to ``x.dtype``."""
    wide = torch.promote_types(x.dtype, torch.float32)
    xw = x.to(wide)
    normed = xw * torch.rsqrt(xw.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.to(wide)).to(x.dtype)


def rope_inv_freq(
    head_dim: int, theta: float, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Inverse wavelengths ``theta ** (-2i / head_dim)`` for ``i < head_dim // 2``, fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines ``[S, head_dim]`` of the rotation angles at ``positions`` ``[S]``.

    Angles are computed in at least fp32 (positions up to 1e5 and more lose whole turns in bf16);
    the halves are repeated (``cat(freqs, freqs)``), the rotate-half layout of Hugging Face
    Llama checkpoints.
    """
    wide = torch.promote_types(dtype, torch.float32)
    angles = positions.to(wide)[:, None] * inv_freq.to(wide)[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, S, H, head_dim]`` by ``cos``/``sin`` ``[S, head_dim]`` (rotate-half).

    Dim ``i`` of the first half pairs with dim ``i`` of the second half, as in Hugging Face
    ``LlamaForCausalLM`` (not the interleaved pairs of Meta's original checkpoints).
    """
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation ``silu(gate) * up``."""
    return F.silu(gate) * up


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``q`` ``[B, H, S, D]`` over ``k``/``v`` ``[B, KV, S, D]``, ``KV | H``.

    Grouped-query attention goes through ``enable_gqa`` rather than ``repeat_interleave``, so
    the kv heads are never copied ``H // KV`` times; it traces under
    ``torch.compile(fullgraph=True)`` and matches the repeated reference exactly on CPU
    (tests/models/llama/test_llama_ops.py). Inside a ``context_parallel`` step it is ring
    attention over the whole sequence split across the cp ranks.
    """
    split = active_split()
    if split is not None:  # context_parallel: q, k, v hold this rank's part of the sequence
        return split.attention(q, k, v, causal=True)
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
    )
