"""The plain math functions of a Llama block against direct references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from d9d.models.llama._ops import attention, rms_norm, rope, rope_cos_sin, rope_inv_freq, swiglu


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` rotated (``rope`` rotates q and k together; here both are ``x``)."""
    q, k = rope(x, x, cos, sin)
    torch.testing.assert_close(q, k, atol=0, rtol=0)
    return q


def test_rms_norm_matches_torch() -> None:
    x, w = _randn(3, 5, 24), _randn(24, seed=1)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), F.rms_norm(x, (24,), w, eps=1e-6))


def test_rms_norm_computes_in_fp32_and_keeps_dtype() -> None:
    x, w = _randn(4, 40, dtype=torch.bfloat16), _randn(40, seed=1, dtype=torch.bfloat16)
    out = rms_norm(x, w, 1e-5)
    assert out.dtype == torch.bfloat16
    expected = F.rms_norm(x.float(), (40,), w.float(), eps=1e-5).bfloat16()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_rope_inv_freq() -> None:
    expected = torch.tensor([1.0, 10.0**-0.5, 0.1, 10.0**-1.5])
    torch.testing.assert_close(rope_inv_freq(8, 100.0), expected)


def test_rope_pairs_dim_i_with_dim_i_plus_half() -> None:
    # head_dim 4: dims (0, 2) rotate at angle p * inv_freq[0], dims (1, 3) at p * inv_freq[1]
    inv_freq = torch.tensor([0.5, 0.25])
    cos, sin = rope_cos_sin(torch.tensor([3]), inv_freq, torch.float32)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    a, b = torch.tensor(1.5), torch.tensor(0.75)
    expected = torch.stack(
        [
            1 * a.cos() - 3 * a.sin(),
            2 * b.cos() - 4 * b.sin(),
            3 * a.cos() + a.sin(),
            4 * b.cos() + 2 * b.sin(),
        ]
    )
    torch.testing.assert_close(_rope_one(x, cos, sin).flatten(), expected)


def test_rope_scores_depend_only_on_relative_position() -> None:
    inv_freq = rope_inv_freq(16, 10_000.0)
    q, k = _randn(1, 1, 1, 16), _randn(1, 1, 1, 16, seed=1)

    def score(pq: int, pk: int) -> torch.Tensor:
        cq, sq = rope_cos_sin(torch.tensor([pq]), inv_freq, torch.float32)
        ck, sk = rope_cos_sin(torch.tensor([pk]), inv_freq, torch.float32)
        return (_rope_one(q, cq, sq) * _rope_one(k, ck, sk)).sum()

    torch.testing.assert_close(score(7, 3), score(1004, 1000))
    torch.testing.assert_close(
        _rope_one(q, *rope_cos_sin(torch.tensor([9]), inv_freq, torch.float32)).norm(),
        q.norm(),
    )


def test_swiglu() -> None:
    gate, up = _randn(6, 11), _randn(6, 11, seed=1)
    torch.testing.assert_close(swiglu(gate, up), gate * torch.sigmoid(gate) * up)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attention_is_causal_gqa(kv_heads: int) -> None:
    q, k, v = (
        _randn(2, 4, 9, 8),
        _randn(2, kv_heads, 9, 8, seed=1),
        _randn(2, kv_heads, 9, 8, seed=2),
    )
    k_rep, v_rep = (t.repeat_interleave(4 // kv_heads, dim=1) for t in (k, v))
    scores = q @ k_rep.transpose(-1, -2) / 8**0.5
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(attention(q, k, v), scores.softmax(-1) @ v_rep)
