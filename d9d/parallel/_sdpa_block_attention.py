"""Block attention on PyTorch's fused SDPA kernels that return the log-sum-exp.

Each kernel returns the output and the log-sum-exp of each query row, and its backward takes
the *final* output and log-sum-exp, which is the contract of
:class:`~d9d.parallel._block_attention.BlockAttention`; none materializes the ``[Sq, Sk]``
scores, unlike the math version. Three kernels, one backend each:

- ``sdpa``: ``aten._scaled_dot_product_flash_attention_for_cpu`` (CPU, any float dtype), the
  one that also takes a mask (as an additive ``0``/``-inf`` bias of the query's dtype), for
  the blocks a sliding window cuts across; ring attention runs those on the math version
  under the CUDA two;
- ``sdpa_flash``: ``aten._scaled_dot_product_flash_attention`` (CUDA, bfloat16 and float16);
- ``sdpa_efficient``: ``aten._scaled_dot_product_efficient_attention`` (CUDA, float32 too);
  its log-sum-exp has the query rows padded to a multiple of 32, sliced off here and padded
  back for the backward, whose ``out`` and ``dout`` are stored heads-inner ([B, S, H, D]) as
  the forward writes ``out``.

The glue is shared: grouped-query attention repeats K/V heads for the kernel and sums their
grads back; the kernels want one head size for Q, K and V (a multiple of 8 on CUDA), so the
head sizes are zero-padded (zeros change neither the scores, whose scale is explicit, nor the
output's real columns) and sliced off again. Dropout is always 0, so the kernels' random
state is never read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._block_attention import BlockAttention, compute_dtype

__all__ = [
    "SDPA_BLOCK_ATTENTION",
    "SDPA_EFFICIENT_BLOCK_ATTENTION",
    "SDPA_FLASH_BLOCK_ATTENTION",
    "cuda_sdpa_unavailable",
    "sdpa_unavailable",
]

_aten = torch.ops.aten
_EFFICIENT_LSE_ROWS = 32  # the memory-efficient kernel pads its log-sum-exp rows to this


@dataclass(frozen=True)
class _Kernel:
    """A fused SDPA kernel with log-sum-exp, on tensors of one head count and head size.

    ``forward(q, k, v, causal, scale) -> (out, lse [B, H, Sq])`` and
    ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``; ``head_multiple``:
    the head size the kernel wants a multiple of; ``masks``: whether both also take
    ``attn_mask=`` (an additive bias ``[Sq, Sk]`` of the query's dtype).
    """

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    head_multiple: int
    masks: bool = False


def _cpu_forward(q, k, v, causal, scale, attn_mask=None):
    return _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=attn_mask, scale=scale
    )


def _cpu_backward(dout, q, k, v, out, lse, causal, scale, attn_mask=None):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=attn_mask, scale=scale
    )


def _flash_forward(q, k, v, causal, scale):
    out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    unused = torch.empty((), dtype=torch.int64, device=q.device)  # random state, dropout 0
    # cum_seq_q / cum_seq_k undefined: one sequence per batch row, not packed (varlen).
    return _aten._scaled_dot_product_flash_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        causal,
        unused,
        unused,
        scale=scale,
    )


def _efficient_forward(q, k, v, causal, scale):
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]]


def _heads_inner(x: torch.Tensor) -> torch.Tensor:
    """``x`` [B, H, S, D] stored as [B, S, H, D], the layout of the efficient kernel's output."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _efficient_backward(dout, q, k, v, out, lse, causal, scale):
    rows = -(-q.shape[2] // _EFFICIENT_LSE_ROWS) * _EFFICIENT_LSE_ROWS
    unused = torch.empty((), dtype=torch.int64, device=q.device)  # random state, dropout 0
    # The kernel reads out (and dout) in the layout its forward wrote out in: given a
    # contiguous [B, H, S, D] out, its bfloat16 dq and dk were wrong on an H100 (float32 right).
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        _heads_inner(dout),
        q,
        k,
        v,
        None,
        _heads_inner(out),
        F.pad(lse, (0, rows - q.shape[2])),
        unused,
        unused,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, dk, dv


def _repeat(kv: torch.Tensor, group: int) -> torch.Tensor:
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def _dense_padded(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` zero-padded to ``size`` on its last dim, copied dense when that dim's stride is
    not 1: the CPU kernel reads rows as dense (a q of last-dim stride 2 gave an output 3.5
    off, grads 1600 off)."""
    if x.shape[-1] != size:
        return F.pad(x, (0, size - x.shape[-1]))
    return x if x.stride(-1) == 1 else x.contiguous()


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The kernel's ``attn_mask=`` for a boolean ``mask`` (none for None): 0 where visible."""
    if mask is None:
        return {}
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return {"attn_mask": zeros.masked_fill(~mask, float("-inf"))}


def _block_attention(name: str, kernel: _Kernel) -> BlockAttention:
    """The :class:`BlockAttention` of ``kernel``: grouped heads and head sizes adapted to it."""

    def padded_size(q: torch.Tensor, v: torch.Tensor) -> int:
        size = max(q.shape[-1], v.shape[-1])
        return -(-size // kernel.head_multiple) * kernel.head_multiple

    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        group, size = q.shape[1] // k.shape[1], padded_size(q, v)
        out, lse = kernel.forward(
            _dense_padded(q, size),
            _dense_padded(_repeat(k, group), size),
            _dense_padded(_repeat(v, group), size),
            causal,
            scale,
            **_bias(mask, q.dtype),
        )
        dtype = compute_dtype(q.dtype)
        return out[..., : v.shape[-1]].to(dtype), lse.to(dtype)

    def backward(
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
        batch, kv_heads = k.shape[:2]
        group, size = q.shape[1] // kv_heads, padded_size(q, v)
        head, v_head = q.shape[-1], v.shape[-1]
        dq, dk, dv = kernel.backward(
            _dense_padded(dout.to(q.dtype), size),
            _dense_padded(q, size),
            _dense_padded(_repeat(k, group), size),
            _dense_padded(_repeat(v, group), size),
            _dense_padded(out.to(q.dtype), size),
            lse.to(torch.promote_types(q.dtype, torch.float32)),
            causal,
            scale,
            **_bias(mask, q.dtype),
        )
        dtype = compute_dtype(q.dtype)
        dk = dk[..., :head].reshape(batch, kv_heads, group, *dk.shape[2:-1], head).sum(2)
        dv = dv[..., :v_head].reshape(batch, kv_heads, group, *dv.shape[2:-1], v_head).sum(2)
        return dq[..., :head].to(dtype), dk.to(dtype), dv.to(dtype)

    return BlockAttention(name, forward, backward, masks=kernel.masks)


def sdpa_unavailable(device_type: str | None) -> str | None:
    """Why the CPU SDPA block attention cannot run on ``device_type`` (None: it can)."""
    if device_type in (None, "cpu"):
        return None
    return f"its fused kernel runs on CPU only; on {device_type} use sdpa_flash or sdpa_efficient"


def cuda_sdpa_unavailable(device_type: str | None) -> str | None:
    """Why a CUDA SDPA block attention cannot run on ``device_type`` (None: it can)."""
    if device_type not in (None, "cuda"):
        return f"its fused kernel runs on CUDA only; on {device_type} use sdpa or reference"
    if not torch.cuda.is_available():
        return "this machine has no CUDA device"
    return None


SDPA_BLOCK_ATTENTION = _block_attention("sdpa", _Kernel(_cpu_forward, _cpu_backward, 1, masks=True))
"""Block attention on the fused CPU SDPA kernel with log-sum-exp (see the module docstring)."""

SDPA_FLASH_BLOCK_ATTENTION = _block_attention(
    "sdpa_flash", _Kernel(_flash_forward, _flash_backward, 8)
)
"""Block attention on CUDA's flash-attention SDPA kernel (bfloat16, float16)."""

SDPA_EFFICIENT_BLOCK_ATTENTION = _block_attention(
    "sdpa_efficient", _Kernel(_efficient_forward, _efficient_backward, 8)
)
"""Block attention on CUDA's memory-efficient SDPA kernel (float32, bfloat16, float16)."""
