"""``d9d.hf``: which rules a model gets, that ``axes=`` wins over them, and that ``import d9d``
never imports ``transformers``."""

from __future__ import annotations

import doctest
import subprocess
import sys

import pytest
import torch
from hf_families import FAMILIES, build, config
from torch import nn

import d9d
from d9d.hf import _rules


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_param_of_every_family_gets_axes_tensor_parallel_knows(family: str) -> None:
    model = build(family)()
    assert d9d.hf.family_of(model.module) == family
    for path, names in model.axes.items():
        assert None not in names and "out" not in names and "in" not in names, (path, names)


def test_the_llama_rules_shard_attention_by_heads_and_norms_over_embed() -> None:
    axes = build("qwen3")().axes
    layer = "model.layers.0."
    assert axes[layer + "self_attn.q_proj.weight"] == ("heads", "embed")
    assert axes[layer + "self_attn.k_proj.weight"] == ("kv_heads", "embed")
    assert axes[layer + "self_attn.o_proj.weight"] == ("embed", "heads")
    assert axes[layer + "self_attn.q_norm.weight"] == ("head_dim",)  # per head, not embed
    assert axes[layer + "mlp.down_proj.weight"] == ("embed", "mlp")
    assert axes[layer + "input_layernorm.weight"] == ("embed",)
    assert axes["model.norm.weight"] == ("embed",)
    assert axes["lm_head.weight"] == ("vocab", "embed")


def test_fused_projections_stay_whole_and_experts_replicated() -> None:
    phi3 = build("phi3")().axes
    assert phi3["model.layers.0.self_attn.qkv_proj.weight"] == ("embed", "embed")
    assert phi3["model.layers.0.mlp.gate_up_proj.weight"] == ("embed", "embed")
    moe = build("qwen3_moe")().axes
    assert moe["model.layers.0.mlp.experts.gate_up_proj"] == ("experts", "expert_mlp", "embed")
    assert moe["model.layers.0.mlp.gate.weight"] == ("experts", "embed")


def test_moe_blocks_are_position_wise_and_nothing_else() -> None:
    for family in FAMILIES:
        paths = build(family)().structure.position_wise
        if family in d9d.hf.POSITION_WISE:
            assert paths == ("model.layers.0.mlp", "model.layers.1.mlp"), family
        else:
            assert paths == (), family
    assert d9d.hf.position_wise_for(build("mixtral")()) == (
        "model.layers.0.mlp",
        "model.layers.1.mlp",
    )
    assert d9d.hf.position_wise_for(nn.Linear(2, 2)) == ()


def test_rules_given_with_axes_win_and_the_others_stay() -> None:
    module = build("llama")().module
    model = d9d.functionalize(module, axes={r"q_proj\.weight$": ("embed", "embed")})
    assert model.axes["model.layers.0.self_attn.q_proj.weight"] == ("embed", "embed")
    assert model.axes["model.layers.0.self_attn.k_proj.weight"] == ("kv_heads", "embed")


def test_axes_for_lists_the_rules_that_match_and_takes_a_model() -> None:
    model = build("gpt2")()
    rules = d9d.hf.axes_for(model)
    assert rules == d9d.hf.axes_for(model.module)
    assert rules[r"(^|\.)c_(attn|proj|fc)\.weight$"] == ("embed", "embed")
    assert rules[r"(^|\.)ln_f\.bias$"] == ("embed",)
    assert not any("q_proj" in pattern for pattern in rules)


def test_a_module_outside_transformers_gets_no_rules() -> None:
    linear = nn.Linear(3, 2)
    assert d9d.hf.axes_for(linear) == {}
    assert d9d.hf.family_of(linear) is None
    assert not d9d.hf.is_hf_model(linear)


def test_a_family_without_rules_gets_its_norms_and_the_defaults() -> None:
    """An unknown model type with no tp plan (a subclass defined outside transformers counts
    as its parent's package): norms of the hidden size get embed; linears keep ("out", "in"),
    which tensor_parallel refuses by name."""
    import transformers

    class Custom(transformers.LlamaForCausalLM):
        _tp_plan = None

    cfg = config("llama")
    cfg.model_type = "custom"
    cfg.base_model_tp_plan = None
    module = Custom(cfg)
    assert d9d.hf.is_hf_model(module) and d9d.hf.family_of(module) == "custom"
    axes = d9d.functionalize(module).axes
    assert axes["model.layers.0.post_attention_layernorm.weight"] == ("embed",)
    assert axes["model.layers.0.self_attn.q_proj.weight"] == ("out", "in")


def test_a_rule_of_the_wrong_rank_names_the_family() -> None:
    """A transformers model whose c_attn is not what GPT-2's hand-written rule expects: the
    rule's error says whose rule it is."""
    module = build("gpt2")().module
    module.transformer.h[0].attn.c_attn = nn.Conv1d(48, 144, 1, bias=False)
    with pytest.raises(ValueError, match=r"from d9d.hf rules of 'gpt2'\) name 2 dims"):
        d9d.functionalize(module)


def test_import_d9d_imports_no_transformers() -> None:
    code = (
        "import sys, torch, d9d; d9d.hf; d9d.functionalize(torch.nn.Linear(2, 2)); "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_apply_returns_the_output_object() -> None:
    model = build("llama")()
    out = model.apply(model.params, torch.zeros(1, 4, dtype=torch.long))
    assert out.logits.shape == (1, 4, 97)


def test_docstring_examples_run() -> None:
    assert doctest.testmod(_rules).failed == 0


def test_apply_passes_no_cache_to_a_hugging_face_model_unless_asked() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = d9d.functionalize(transformers.LlamaForCausalLM(config))
    assert model.defaults == {"use_cache": False} == d9d.hf.apply_defaults(model.module)
    tokens = torch.zeros(1, 5, dtype=torch.long)
    assert model.apply(model.params, tokens).past_key_values is None
    assert model.apply(model.params, tokens, use_cache=True).past_key_values is not None
    assert d9d.functionalize(torch.nn.Linear(2, 2)).defaults == {}
