"""The MoE presets are the architectures they name: OLMoE-1B-7B against ``transformers``'
``OlmoeForCausalLM`` (param count and shapes on meta, logits of a small config in float64),
Qwen3-30B-A3B's count, and DeepSeek-V3's routed layer (sigmoid scores, groups, bias, scaling,
a shared expert) against ``DeepseekV3MoE``."""

from __future__ import annotations

import pytest
import torch

import d9d
from d9d.cli.plan._measured_step import plan_step
from d9d.errors import PlanError
from d9d.models import MoE, MoEConfig
from d9d.moe import MoE as MoELayer
from d9d.moe import MoEConfig as LayerConfig
from d9d.moe import route
from d9d.testing import fake_world

transformers = pytest.importorskip("transformers")

# transformers runs OLMoE's RMSNorms and router softmax in float32 (float64 here).
TOL = {"rtol": 1e-6, "atol": 1e-6}


def _olmoe_config(**fields: object) -> transformers.OlmoeConfig:
    """allenai/OLMoE-1B-7B-0924's config.json, with ``fields`` replaced."""
    published = dict(
        vocab_size=50_304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, rms_norm_eps=1e-5, rope_theta=10_000.0, clip_qkv=None,
        max_position_embeddings=4096, tie_word_embeddings=False, router_aux_loss_coef=0.01,
    )  # fmt: skip
    return transformers.OlmoeConfig(**(published | fields))


def test_olmoe_preset_has_the_params_of_olmoe_1b_7b() -> None:
    """Its q/k norms span all heads (2048 wide, not one 128-wide norm per head) and its norm
    eps is 1e-5: the preset had 61,440 params fewer (6,919,100,416) and eps 1e-6."""
    with torch.device("meta"):
        hf = transformers.OlmoeForCausalLM(_olmoe_config())
    config = MoEConfig.preset("olmoe-1b-7b")
    model = MoE(config, device="meta")
    total = sum(p.numel() for p in hf.parameters())
    assert total == 6_919_161_856
    assert config.num_params == sum(p.numel() for p in model.parameters()) == total
    attn = hf.model.layers[0].self_attn
    assert model.layers[0].attn.q_norm.weight.shape == attn.q_norm.weight.shape == (2048,)
    assert model.layers[0].attn.k_norm.weight.shape == attn.k_norm.weight.shape == (2048,)
    assert config.norm_eps == hf.config.rms_norm_eps == 1e-5


def _hf_to_d9d(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {
        "embed.weight": hf.model.embed_tokens.weight,
        "norm.weight": hf.model.norm.weight,
        "head.weight": hf.lm_head.weight,
    }
    for i, layer in enumerate(hf.model.layers):
        attn, mlp, ours = layer.self_attn, layer.mlp, f"layers.{i}"
        gate, up = mlp.experts.gate_up_proj.chunk(2, dim=1)  # [E, 2I, H]
        state |= {
            f"{ours}.attn_norm.weight": layer.input_layernorm.weight,
            f"{ours}.mlp_norm.weight": layer.post_attention_layernorm.weight,
            f"{ours}.attn.wq.weight": attn.q_proj.weight,
            f"{ours}.attn.wk.weight": attn.k_proj.weight,
            f"{ours}.attn.wv.weight": attn.v_proj.weight,
            f"{ours}.attn.wo.weight": attn.o_proj.weight,
            f"{ours}.attn.q_norm.weight": attn.q_norm.weight,
            f"{ours}.attn.k_norm.weight": attn.k_norm.weight,
            f"{ours}.mlp.router.weight": mlp.gate.weight,
            f"{ours}.mlp.experts.w_gate": gate.transpose(1, 2),
            f"{ours}.mlp.experts.w_up": up.transpose(1, 2),
            f"{ours}.mlp.experts.w_down": mlp.experts.down_proj.transpose(1, 2),
        }
    return {name: tensor.detach() for name, tensor in state.items()}


def test_olmoe_shaped_logits_match_transformers() -> None:
    """A small OLMoE (GQA, so the q and k norms differ in width) with the preset's flags."""
    fields = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24)
    config = MoEConfig.olmoe_1b_7b(
        **fields, max_seq_len=64, moe=LayerConfig(dim=32, n_experts=6, top_k=2, expert_dim=24)
    )
    hf_config = _olmoe_config(
        vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
        max_position_embeddings=64, eos_token_id=None, pad_token_id=None,
        experts_implementation="eager",
    )  # fmt: skip
    hf = transformers.OlmoeForCausalLM(hf_config).to(torch.float64).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random norms too, so a swapped or ignored norm weight shows
        for name, param in hf.named_parameters():
            scale = 1.0 if name.endswith("mlp.gate.weight") else 0.1
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    ours = MoE(config).to(torch.float64).eval()
    ours.load_state_dict(_hf_to_d9d(hf))
    tokens = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits, hf(tokens).logits, **TOL)


def test_norms_over_all_heads_are_refused_under_tensor_parallel() -> None:
    """Sharding the heads would give each rank the statistics of its own heads only."""
    with fake_world(2):
        with torch.device("meta"):
            model = d9d.functionalize(MoE(MoEConfig.tiny(qk_norm="full")))
        sizes = {"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "tp": 2}
        step, opt = plan_step(model, sizes, "moe", None, "none", "1f1b", 1)
        with pytest.raises(PlanError, match=r"q_norm\.weight' has logical axis .norm over all"):
            step.place(model.params, opt.init(model.params), model=model)


def test_olmoe_preset_plans_on_fsdp() -> None:
    from torch.distributed.tensor import Shard

    with fake_world(8), torch.device("meta"):
        mesh = d9d.make_mesh("cpu", fsdp=8)
        model = d9d.functionalize(MoE(MoEConfig.preset("olmoe-1b-7b")))
        plan = d9d.shard_params(mesh)(lambda p, s, b: (p, s, {})).make_plan(
            model.params, model.axes
        )
    assert plan.entries["layers.0.attn.q_norm.weight"].storage == (Shard(0),)
    assert plan.total_bytes() == 6_919_161_856 * 4


def test_norms_over_all_heads_refuse_a_rank_holding_some_heads() -> None:
    """Axes overridden to shard the heads anyway reach the forward with part of q."""
    model = MoE(MoEConfig.tiny(qk_norm="full"))
    attn = model.layers[0].attn
    attn.wq = torch.nn.Linear(64, 32, bias=False)  # 2 of the 4 heads, as on one of 2 tp ranks
    with pytest.raises(ValueError, match="normalizes all 64 query features at once, but this"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_qwen3_preset_has_the_params_of_qwen3_30b_a3b() -> None:
    published = dict(
        vocab_size=151_936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=40_960, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**published))
    config = MoEConfig.preset("qwen3-30b-a3b")
    assert config.num_params == sum(p.numel() for p in hf.parameters()) == 30_532_122_624
    assert (config.norm_eps, config.rope_theta, config.max_seq_len) == (1e-6, 1e6, 40_960)


def test_deepseek_v3_routed_layer_matches_transformers() -> None:
    """The preset's routing flags on a small layer: 16 experts in 4 groups (2 used), top-4."""
    preset = MoEConfig.preset("deepseek-v3").moe
    flags = {
        name: getattr(preset, name)
        for name in ("score_func", "norm_topk", "routed_scaling_factor", "n_shared_experts")
    }
    config = LayerConfig(
        dim=32, n_experts=16, top_k=4, expert_dim=24, n_group=4, topk_group=2,
        bias_update_rate=1e-3, **flags,
    )  # fmt: skip
    hf_config = transformers.DeepseekV3Config(
        hidden_size=32, moe_intermediate_size=24, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, n_shared_experts=preset.n_shared_experts,
        routed_scaling_factor=preset.routed_scaling_factor, norm_topk_prob=preset.norm_topk,
        experts_implementation="eager",
    )  # fmt: skip
    hf = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(hf_config)
    hf = hf.to(torch.float64)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        hf.gate.e_score_correction_bias.copy_(torch.randn(16, generator=generator) * 0.05)
    ours = MoELayer(config).to(torch.float64)
    gate, up = hf.experts.gate_up_proj.detach().chunk(2, dim=1)  # [E, 2I, H]
    shared = hf.shared_experts
    ours.load_state_dict({
        "router.weight": hf.gate.weight.detach(),
        "router.expert_bias": hf.gate.e_score_correction_bias,
        "experts.w_gate": gate.transpose(1, 2),
        "experts.w_up": up.transpose(1, 2),
        "experts.w_down": hf.experts.down_proj.detach().transpose(1, 2),
        "shared.w_gate.weight": shared.gate_proj.weight.detach(),
        "shared.w_up.weight": shared.up_proj.weight.detach(),
        "shared.w_down.weight": shared.down_proj.weight.detach(),
    })  # fmt: skip
    x = torch.randn(3, 7, 32, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x)
        routing = route(x.view(-1, 32) @ ours.router.weight.T, config, ours.router.expert_bias)
        assert torch.equal(routing.expert_ids.sort(-1).values, hf_ids.sort(-1).values)
        by_expert = routing.weights.gather(-1, routing.expert_ids.argsort(-1))
        # transformers' router runs in float32: its weights agree to ~1e-7
        hf_by_expert = hf_weights.gather(-1, hf_ids.argsort(-1)).double()
        torch.testing.assert_close(by_expert, hf_by_expert, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours(x).out, hf(x), rtol=1e-6, atol=1e-5)
