"""Attention of one query block against one key/value block, with its log-sum-exp.

Ring attention calls this once per (query rows, K/V block) pair and merges the partial
outputs by their log-sum-exp. :class:`BlockAttention` is the seam for faster backends: a GPU
backend can wrap SDPA kernels that return the log-sum-exp (flash or efficient attention) and
their backward, as long as it keeps the contract below. :data:`MATH_BLOCK_ATTENTION` is the
pure-PyTorch version, exact on CPU in float32 and float64.

Contract (``H`` query heads, ``KV`` key/value heads, ``H % KV == 0``; query head ``h`` uses
key/value head ``h // (H // KV)``, as ``repeat_interleave`` on the head dim would):

- ``forward(q [B, H, Sq, D], k [B, KV, Sk, D], v [B, KV, Sk, Dv], *, scale, causal)``
  returns ``(out [B, H, Sq, Dv], lse [B, H, Sq])`` in the compute dtype (float32, or
  float64 for float64 inputs). ``causal=True`` only occurs with ``Sq == Sk`` and means the
  top-left aligned lower triangle (query ``i`` sees keys ``0..i``).
- ``backward(q, k, v, out, dout, lse, *, scale, causal)`` returns ``(dq, dk, dv)`` in the
  compute dtype, where ``out``/``lse`` are the *final* merged output and log-sum-exp of these
  query rows (the flash-attention recompute formulation), so the probabilities
  ``exp(q k^T * scale - lse)`` are those of the full attention.
- A backend with ``masks=True`` also takes ``mask=`` (a boolean ``[Sq, Sk]``, True where the
  query sees the key; ``causal`` is then False) in both; ring attention passes one only for a
  block a sliding window cuts across, and runs such blocks on :data:`MATH_BLOCK_ATTENTION`
  for a backend without ``masks``. A row whose keys are all masked gets a zero output and
  an ``lse`` of ``-inf``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["MATH_BLOCK_ATTENTION", "BlockAttention", "compute_dtype", "finite_or_zero"]

BlockForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
BlockBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class BlockAttention:
    """A block attention backend: a forward returning ``(out, lse)`` and its backward.

    Attributes:
        name: Shown in errors and docs.
        forward: ``(q, k, v, *, scale, causal) -> (out, lse)``; see the module docstring.
        backward: ``(q, k, v, out, dout, lse, *, scale, causal) -> (dq, dk, dv)``.
        masks: Whether both also take ``mask=`` (a boolean ``[Sq, Sk]``).
    """

    name: str
    forward: BlockForward
    backward: BlockBackward
    masks: bool = False


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype block outputs, log-sum-exps and gradient sums are kept in."""
    return torch.promote_types(dtype, torch.float32)


def finite_or_zero(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (a row that saw no key yet) read as 0, to subtract safely."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _scores(
    q: torch.Tensor, k: torch.Tensor, *, scale: float, causal: bool, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scaled scores ``[B, KV, G * Sq, Sk]`` and q, k in the compute dtype, grouped by KV head."""
    batch, heads, seq_q, dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dtype = compute_dtype(q.dtype)
    # [B, H, Sq, D] -> [B, KV, G * Sq, D]: the G query heads of one K/V head share a matmul,
    # so K/V are never repeated in memory.
    qg = q.to(dtype).reshape(batch, kv_heads, group * seq_q, dim)
    kc = k.to(dtype)
    scores = torch.matmul(qg, kc.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.view(batch, kv_heads, group, seq_q, seq_k).masked_fill(~mask, float("-inf"))
        scores = scores.view(batch, kv_heads, group * seq_q, seq_k)
    return scores, qg, kc


def _math_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seq_q, _ = q.shape
    scores, _, _ = _scores(q, k, scale=scale, causal=causal, mask=mask)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - finite_or_zero(lse))  # a row with no key: zeros, not NaN
    out = torch.matmul(probs, v.to(scores.dtype))
    return out.view(batch, heads, seq_q, v.shape[-1]), lse.view(batch, heads, seq_q)


def _math_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, heads, seq_q, dim = q.shape
    kv_heads = k.shape[1]
    scores, qg, kc = _scores(q, k, scale=scale, causal=causal, mask=mask)
    dtype = scores.dtype
    rows = scores.shape[2]
    probs = torch.exp(scores - lse.to(dtype).reshape(batch, kv_heads, rows, 1))
    dout_g = dout.to(dtype).reshape(batch, kv_heads, rows, -1)
    out_g = out.to(dtype).reshape(batch, kv_heads, rows, -1)
    # The matmuls over the G * Sq rows sum the G query heads' shares of dK and dV.
    dv = torch.matmul(probs.transpose(-1, -2), dout_g)
    dprobs = torch.matmul(dout_g, v.to(dtype).transpose(-1, -2))
    delta = (dout_g * out_g).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta)
    dq = (torch.matmul(dscores, kc) * scale).view(batch, heads, seq_q, dim)
    dk = torch.matmul(dscores.transpose(-1, -2), qg) * scale
    return dq, dk, dv


MATH_BLOCK_ATTENTION = BlockAttention("math", _math_forward, _math_backward, masks=True)
"""Pure-PyTorch block attention: explicit scores, runs on any device, exact in float64."""
