"""rope: every backend against the reference (and the reference against Hugging Face)."""

from __future__ import annotations

import pytest
import torch

import d9d.kernels as K
from d9d.errors import KernelInputError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (batch, seq, q heads, k heads, head_dim, cos/sin leading shape: "s", "1s" or "bs")
CASES = [(3, 7, 4, 2, 48, "bs"), (1, 1, 32, 8, 128, "s"), (5, 123, 3, 1, 10, "1s")]


def _tables(batch, seq, head_dim, layout, device):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = torch.arange(seq, dtype=torch.float32)[None, :] + torch.arange(batch)[:, None]
    angles = positions[..., None] * inv_freq  # [B, S, D/2]
    angles = torch.cat([angles, angles], dim=-1).to(device)
    table = {"s": angles[0], "1s": angles[:1], "bs": angles}[layout]
    return table.cos(), table.sin()


def _run(backend, q, k, cos, sin, upstream):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    outputs = K.rope(q, k, cos, sin, backend=backend)
    torch.autograd.backward(outputs, upstream)
    return outputs[0].detach(), outputs[1].detach(), q.grad, k.grad


def test_reference_matches_hugging_face_llama():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    cos, sin = _tables(2, 5, 8, "bs", "cpu")
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    q_ours, k_ours = K.rope(q, k, cos, sin, backend="reference")
    torch.testing.assert_close(q_ours, q_hf.transpose(1, 2))
    torch.testing.assert_close(k_ours, k_hf.transpose(1, 2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_rope_triton(case, dtype, device, assert_close):
    torch.manual_seed(0)
    batch, seq, q_heads, k_heads, head_dim, layout = case
    q = torch.randn(batch, seq, q_heads, head_dim, device=device).to(dtype)
    k = torch.randn(batch, seq, k_heads, head_dim, device=device).to(dtype)
    cos, sin = _tables(batch, seq, head_dim, layout, device)
    upstream = (torch.randn_like(q), torch.randn_like(k))
    got = _run("triton", q, k, cos, sin, upstream)
    ref = _run("reference", q, k, cos, sin, upstream)
    for actual, expected in zip(got, ref, strict=True):
        assert_close(actual, expected, dtype)


def test_general_cos_sin_and_strided_inputs(device, assert_close):
    torch.manual_seed(0)
    batch, seq, heads, head_dim = 2, 6, 3, 12
    qkv = torch.randn(batch, seq, 3 * heads * head_dim, device=device)  # a fused projection
    q = qkv[..., : heads * head_dim].view(batch, seq, heads, head_dim)
    k = torch.randn(batch, heads, seq, head_dim, device=device).transpose(1, 2)
    # Halves with different angles, and tables strided in the last dim.
    cos = torch.randn(seq, 2 * head_dim, device=device)[:, ::2]
    sin = torch.randn(seq, 2 * head_dim, device=device)[:, ::2]
    upstream = (torch.randn(q.shape, device=device), torch.randn(k.shape, device=device))
    got = _run("triton", q, k, cos, sin, upstream)
    dense = [t.contiguous() for t in (q, k, cos, sin)]
    ref = _run("reference", *dense, upstream)
    for actual, expected in zip(got, ref, strict=True):
        assert_close(actual, expected, torch.float32)


def test_errors():
    q, table = torch.randn(1, 2, 3, 4), torch.randn(2, 4)
    with pytest.raises(KernelInputError, match=r"q and k must be \[batch, seq, heads, head_dim\]"):
        K.rope(q[0], q[0], table, table)
    with pytest.raises(KernelInputError, match=r"head_dim must be even"):
        K.rope(q[..., :3], q[..., :3], table[:, :3], table[:, :3])
    with pytest.raises(KernelInputError, match=r"k must match q in batch, seq and head_dim"):
        K.rope(q, torch.randn(1, 3, 3, 4), table, table)
    with pytest.raises(KernelInputError, match=r"rope: cos.shape=\(3, 4\), expected one of"):
        K.rope(q, q, torch.randn(3, 4), table)
    with pytest.raises(KernelInputError, match=r"q.dtype=torch.float32, k.dtype=torch.bfloat16"):
        K.rope(q, q.bfloat16(), table, table)
