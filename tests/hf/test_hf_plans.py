"""``d9d.hf`` reads ``transformers``' own tensor-parallel plans: each style the installed
families use is handled or refused by name, norms over a projection's whole output follow it."""

from __future__ import annotations

import pytest
import torch

import d9d
from d9d.errors import RankFailedError
from d9d.hf import _tp_plan
from d9d.testing import run_on_ranks

transformers = pytest.importorskip("transformers")


def _tiny(config_class, **fields):
    sizes = dict(
        vocab_size=97, hidden_size=48, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    return config_class(**{**sizes, **fields})


def test_every_style_of_the_installed_plans_is_handled_or_named() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    styles = set()
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config_class = transformers.CONFIG_MAPPING[model_type]
        except KeyError:
            continue
        styles |= set((getattr(config_class, "base_model_tp_plan", None) or {}).values())
    assert {"colwise", "rowwise", "colwise_gather_output", "moe_tp_experts"} <= styles
    for style in styles - set(d9d.hf.IMPLEMENTED_STYLES):
        axes = _tp_plan._axes(style, "model.layers.0.mlp.x", "weight", (8, 8), frozenset({4}))
        assert axes[0] == f"tp plan style {style} (not implemented by d9d)", style


def test_the_plan_gives_granite_its_axes_without_a_table() -> None:
    model = d9d.functionalize(transformers.GraniteForCausalLM(_tiny(transformers.GraniteConfig)))
    assert d9d.hf.family_of(model.module) not in d9d.hf.FAMILIES
    layer = "model.layers.0."
    assert model.axes[layer + "self_attn.q_proj.weight"] == ("heads", "embed")
    assert model.axes[layer + "self_attn.v_proj.weight"] == ("kv_heads", "embed")
    assert model.axes[layer + "self_attn.o_proj.weight"] == ("embed", "heads")
    assert model.axes[layer + "mlp.up_proj.weight"] == ("mlp", "embed")
    assert model.axes[layer + "mlp.down_proj.weight"] == ("embed", "mlp")
    assert model.axes["lm_head.weight"] == ("vocab", "embed")


def test_per_head_norms_of_a_config_whose_head_size_varies_per_layer() -> None:
    # Gemma-4's full-attention layers have heads of their own size (global_head_dim), so its
    # config refuses a global head_dim: each layer's q/k norms are named by their own.
    config_class = transformers.CONFIG_MAPPING["gemma4_unified_text"]
    config = _tiny(config_class, num_hidden_layers=2, head_dim=8, global_head_dim=16)
    module = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[config_class](config)
    model = d9d.functionalize(module)
    for layer, size in ((0, 8), (1, 16)):
        path = f"model.layers.{layer}.self_attn.q_norm.weight"
        assert (model.params[path].shape, model.axes[path]) == ((size,), ("head_dim",))


def _olmo2(plan: dict[str, str] | None = None) -> d9d.Model:
    config = _tiny(transformers.Olmo2Config)
    if plan is not None:
        config.base_model_tp_plan = plan
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return d9d.functionalize(transformers.Olmo2ForCausalLM(config))


def test_olmo2_norms_over_all_heads_follow_their_gathered_projections() -> None:
    """Olmo2's plan gathers q/k/v (colwise_gather_output), whose norms span every head: the
    attention stays whole on tp and its norms with it (replicated, not per head)."""
    axes = _olmo2().axes
    layer = "model.layers.0.self_attn."
    assert axes[layer + "q_proj.weight"] == ("embed", "embed")
    assert axes[layer + "o_proj.weight"] == ("embed", "embed")
    assert axes[layer + "q_norm.weight"] == axes[layer + "k_norm.weight"] == ("embed",)


def _place(make, **options) -> None:
    model = make()
    step = d9d.tensor_parallel(d9d.make_mesh("cpu", tp=2), **options)(lambda p, s, b: (p, s, {}))
    step.place(model.params, (), model=model)


def test_olmo2_under_sequence_parallelism_is_refused_with_the_fix() -> None:
    with pytest.raises(
        RankFailedError,
        match=r"module 'model.layers.0.self_attn' holds .* whole on 'tp' .* or use "
        r"tensor_parallel\(\.\.\., sequence_parallel=False\)",
    ):
        run_on_ranks(_place, 2, _olmo2)


def test_a_norm_over_heads_sharded_by_the_plan_is_refused_by_name() -> None:
    """Were Olmo2's q/k/v colwise, its norms' statistics would span ranks: refused."""
    plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
    }
    with pytest.raises(
        RankFailedError,
        match=r"param 'model.layers.0.self_attn.q_norm.weight' has logical axis 'norm over the "
        r"output of a colwise projection, whose heads span the tp ranks \(not implemented",
    ):
        run_on_ranks(_place, 2, lambda: _olmo2(plan))


def test_a_style_d9d_does_not_implement_is_refused_under_tp_only() -> None:
    config = _tiny(transformers.LlamaConfig)
    config.base_model_tp_plan = {
        **config.base_model_tp_plan,
        "layers.*.mlp.up_proj": "packed_colwise",
    }
    model = d9d.functionalize(transformers.LlamaForCausalLM(config))
    assert model.axes["model.layers.0.mlp.up_proj.weight"][0] == (
        "tp plan style packed_colwise (not implemented by d9d)"
    )
    with pytest.raises(RankFailedError, match=r"up_proj.weight' has logical axis 'tp plan style"):
        run_on_ranks(_place, 2, lambda: d9d.functionalize(transformers.LlamaForCausalLM(config)))


def test_blocks_are_the_layers_the_pipeline_plan_names() -> None:
    """Another ModuleList beside the decoder layers (Phi-4-multimodal's encoders) holds no
    blocks of the pipeline: only the list base_model_pp_plan names does."""
    module = transformers.LlamaForCausalLM(_tiny(transformers.LlamaConfig, num_hidden_layers=2))
    module.model.adapters = torch.nn.ModuleList([torch.nn.Linear(48, 48)])
    blocks = [b.path for b in d9d.functionalize(module).structure.blocks]
    assert blocks == ["model.layers.0", "model.layers.1"]
    assert d9d.hf.block_lists_for(module) == ("model.layers",)
    module.config.base_model_pp_plan = None  # no plan: the outermost lists, as for any module
    assert d9d.hf.block_lists_for(module) == ()
    blocks = [b.path for b in d9d.functionalize(module).structure.blocks]
    assert blocks == ["model.layers.0", "model.layers.1", "model.adapters.0"]
