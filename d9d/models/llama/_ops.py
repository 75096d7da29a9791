"""The math of a Llama block: RMSNorm, RoPE, SwiGLU and causal GQA attention.

``rms_norm``, ``rope`` and ``swiglu`` are the ``d9d.kernels`` ops: the registry picks their
backend per call (Triton on CUDA, the pure-PyTorch reference on CPU), and
``d9d.kernels.use(...)`` or ``D9D_KERNELS`` force one, with no change to the model. The
references compute in float32 and round once to the activations' dtype, as the Triton
backends do. Modules in ``_model.py`` only hold weights and call these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core._context import sequence_attention
from ...kernels import rms_norm as rms_norm
from ...kernels import rope as rope
from ...kernels import swiglu as swiglu

__all__ = ["attention", "rms_norm", "rope", "rope_cos_sin", "rope_inv_freq", "swiglu"]


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of ``q`` ``[B, H, S, D]`` over ``k``/``v`` ``[B, KV, S, D]``, ``KV | H``.

    Grouped-query attention goes through ``enable_gqa`` rather than ``repeat_interleave``, so
    the kv heads are never copied ``H // KV`` times; it traces under
    ``torch.compile(fullgraph=True)`` and matches the repeated reference exactly on CPU
    (tests/models/llama/test_llama_ops.py). Inside a ``context_parallel`` step it is ring
    attention over the whole sequence split across the cp ranks.
    """
    attend = sequence_attention()
    if attend is not None:  # context_parallel: q, k, v hold this rank's part of the sequence
        return attend(q, k, v, causal=True)
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
    )
