"""d9d Llama reproduces Hugging Face ``LlamaForCausalLM`` logits: same RoPE, GQA and RMSNorm."""

from __future__ import annotations

import pytest
import torch

from d9d.checkpoint import llama_from_hf  # the one key table, shared with export/import
from d9d.models import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")


def _hf_model(cfg: LlamaConfig) -> torch.nn.Module:
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        intermediate_size=cfg.ffn_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random norms too, so a swapped or ignored norm weight shows
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_hugging_face(tied: bool) -> None:
    cfg = LlamaConfig.tiny(rope_theta=1234.0, norm_eps=1e-6, tie_embeddings=tied)
    hf = _hf_model(cfg)
    ours = Llama(cfg).eval()
    state = llama_from_hf(hf.state_dict(), cfg)  # drops the tied lm_head
    ours.load_state_dict(state, strict=False)
    assert set(state) == {name for name, _ in ours.named_parameters()}
    tokens = torch.randint(0, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_positions_offset_matches_hugging_face() -> None:
    cfg = LlamaConfig.tiny(rope_theta=500_000.0)
    hf = _hf_model(cfg)
    ours = Llama(cfg).eval()
    ours.load_state_dict(llama_from_hf(hf.state_dict(), cfg))
    tokens = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(100, 116)
    with torch.no_grad():
        expected = hf(tokens, position_ids=positions[None]).logits
        got = ours(tokens, positions)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
