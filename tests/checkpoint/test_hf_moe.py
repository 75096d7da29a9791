"""The d9d MoE decoder and ``transformers``' ``Qwen3MoeForCausalLM`` compute the same logits,
on imported weights and after an export (float64, a small random config)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import d9d
from d9d.checkpoint import export_hf_moe, import_hf_moe, moe_from_hf
from d9d.errors import ConfigError, ParamTreeMismatchError
from d9d.models import MoE, MoEConfig
from d9d.moe import MoEConfig as LayerConfig

transformers = pytest.importorskip("transformers")

# The router's softmax runs in float32 in transformers (float64 here): weights agree to ~1e-8.
TOL = {"rtol": 1e-6, "atol": 1e-6}


def _hf_model() -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
        mlp_only_layers=[0], max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False, experts_implementation="eager",
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float64).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random norms too, so a swapped or ignored norm weight shows
        for name, param in model.named_parameters():
            scale = 1.0 if name.endswith("mlp.gate.weight") else 0.1
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))


def test_imported_weights_give_hugging_face_logits(tmp_path) -> None:
    hf = _hf_model()
    hf.save_pretrained(tmp_path)  # the Hub layout: one gate/up/down_proj per expert
    config, params = import_hf_moe(tmp_path)
    assert (config.n_dense_layers, config.head_dim, config.moe.n_experts) == (1, 16, 6)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in _stored_keys(tmp_path)
    ours = MoE(config).to(torch.float64).eval()
    ours.load_state_dict(params)
    in_memory = moe_from_hf(hf.state_dict(), config)  # transformers' merged experts
    assert d9d.tree.map(torch.equal, in_memory, params) == {k: True for k in params}
    with torch.no_grad():
        torch.testing.assert_close(ours(_tokens()).logits, hf(_tokens()).logits, **TOL)


def _stored_keys(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def _qwen3_shaped(**moe: object) -> MoEConfig:
    layer = LayerConfig(dim=64, n_experts=5, top_k=2, expert_dim=24, norm_topk=True, **moe)
    return MoEConfig.tiny(n_layers=3, qk_norm=True, head_dim=8, moe=layer)


def test_export_reloads_in_transformers_with_the_same_logits(tmp_path) -> None:
    config = _qwen3_shaped(bias_update_rate=1e-3)  # a zero bias exports
    model = MoE(config).to(torch.float64).eval()
    with torch.no_grad():  # norms away from 1, so a dropped norm would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
            if name.endswith("router.weight"):
                param.mul_(50)
    params = dict(model.named_parameters())
    export_hf_moe(params, config, tmp_path)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(_tokens()).logits, model(_tokens()).logits, **TOL)
    config_back, params_back = import_hf_moe(tmp_path)
    assert config_back.moe.n_experts == 5 and config_back.n_dense_layers == 1
    for key, value in params_back.items():
        assert torch.equal(value, params[key].detach()), key


def test_a_config_qwen3_moe_cannot_hold_is_named(tmp_path) -> None:
    config = MoEConfig.tiny()  # one shared expert, no qk norm
    with pytest.raises(ConfigError, match="needs qk_norm=True"):
        export_hf_moe(d9d.functionalize(MoE(config)).params, config, tmp_path)
    config = _qwen3_shaped(n_shared_experts=1)
    with pytest.raises(ConfigError, match="needs n_shared_experts=0"):
        export_hf_moe(d9d.functionalize(MoE(config)).params, config, tmp_path)


def test_a_nonzero_router_bias_is_named(tmp_path) -> None:
    config = _qwen3_shaped(bias_update_rate=1e-3)
    params = dict(d9d.functionalize(MoE(config)).params)
    params["layers.1.mlp.router.expert_bias"] = torch.ones(5)
    with pytest.raises(ConfigError, match="expert_bias is not zero"):
        export_hf_moe(params, config, tmp_path)


def test_a_param_the_config_has_no_place_for_is_named(tmp_path) -> None:
    """The export refuses params it would drop: another layer, a shared expert."""
    params = dict(d9d.functionalize(MoE(_qwen3_shaped())).params)
    config = dataclasses.replace(_qwen3_shaped(), n_layers=2)
    with pytest.raises(ParamTreeMismatchError, match=r"hold \['layers.2.attn.k_norm.weight'"):
        export_hf_moe(params, config, tmp_path)
    params = dict(d9d.functionalize(MoE(config)).params)
    params["layers.1.mlp.shared.w_gate.weight"] = torch.zeros(8, 64)
    with pytest.raises(ParamTreeMismatchError, match=r"\['layers.1.mlp.shared.w_gate.weight'\]"):
        export_hf_moe(params, config, tmp_path)
