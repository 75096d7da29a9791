"""d9d Llama reproduces Hugging Face ``LlamaForCausalLM`` logits: same RoPE, GQA and RMSNorm."""

from __future__ import annotations

import re

import pytest
import torch

from d9d.models import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")

# Hugging Face key regex -> d9d key template. A later issue moves this table to checkpoint
# interop; here it only proves the two models compute the same function.
HF_TO_D9D = {
    r"^model\.embed_tokens\.weight$": "embed.weight",
    r"^model\.layers\.(\d+)\.self_attn\.q_proj\.weight$": r"layers.\1.attn.wq.weight",
    r"^model\.layers\.(\d+)\.self_attn\.k_proj\.weight$": r"layers.\1.attn.wk.weight",
    r"^model\.layers\.(\d+)\.self_attn\.v_proj\.weight$": r"layers.\1.attn.wv.weight",
    r"^model\.layers\.(\d+)\.self_attn\.o_proj\.weight$": r"layers.\1.attn.wo.weight",
    r"^model\.layers\.(\d+)\.mlp\.gate_proj\.weight$": r"layers.\1.mlp.w_gate.weight",
    r"^model\.layers\.(\d+)\.mlp\.up_proj\.weight$": r"layers.\1.mlp.w_up.weight",
    r"^model\.layers\.(\d+)\.mlp\.down_proj\.weight$": r"layers.\1.mlp.w_down.weight",
    r"^model\.layers\.(\d+)\.input_layernorm\.weight$": r"layers.\1.attn_norm.weight",
    r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$": r"layers.\1.mlp_norm.weight",
    r"^model\.norm\.weight$": "norm.weight",
    r"^lm_head\.weight$": "head.weight",
}


def _d9d_key(hf_key: str) -> str:
    matches = [re.sub(p, t, hf_key) for p, t in HF_TO_D9D.items() if re.search(p, hf_key)]
    assert len(matches) == 1, (hf_key, matches)
    return matches[0]


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
    state = {_d9d_key(k): v for k, v in hf.state_dict().items()}
    if tied:
        state.pop("head.weight")
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
    ours.load_state_dict({_d9d_key(k): v for k, v in hf.state_dict().items()})
    tokens = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(100, 116)
    with torch.no_grad():
        expected = hf(tokens, position_ids=positions[None]).logits
        got = ours(tokens, positions)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
