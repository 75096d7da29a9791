"""``d9d.hf`` keeps whole on tp the block children no rule could shard exactly (mamba and
linear-attention mixers, mixers a plan leaves out), as ``transformers`` replicates what its
plan does not name; a param without a rule inside a sharded module stays refused."""

from __future__ import annotations

import pytest
from sweep import build

import d9d
from d9d.errors import RankFailedError
from d9d.testing import run_on_ranks

pytest.importorskip("transformers")


def test_a_mamba_mixer_is_kept_whole_beside_a_sharded_mlp() -> None:
    axes = build("jamba")().axes
    mamba = "model.layers.0.mamba."
    assert axes[mamba + "in_proj.weight"] == ("embed", "embed")
    assert axes[mamba + "conv1d.weight"] == ("embed", "embed", "embed")
    assert axes[mamba + "A_log"] == ("embed", "embed")
    assert axes[mamba + "D"] == ("embed",)
    assert axes["model.layers.0.feed_forward.gate_proj.weight"] == ("mlp", "embed")
    assert axes["model.layers.0.feed_forward.down_proj.weight"] == ("embed", "mlp")
    # The routed experts of the MoE layers keep their names (expert_parallel reads them).
    assert axes["model.layers.1.feed_forward.experts.gate_up_proj"][0] == "experts"


def test_a_planned_mixer_holding_a_convolution_is_kept_whole_plan_and_all() -> None:
    """Qwen3-Next's plan shards its gated delta net's projections, whose rows are packed
    q|k|v|z groups that its conv1d's channels would have to follow: the net stays whole,
    the MoE layer beside it sharded by the plan."""
    axes = build("qwen3_next")().axes
    net = "model.layers.0.linear_attn."
    assert axes[net + "in_proj_qkvz.weight"] == ("embed", "embed")
    assert axes[net + "out_proj.weight"] == ("embed", "embed")
    assert axes[net + "dt_bias"] == ("embed",)
    assert axes["model.layers.0.mlp.shared_expert.gate_proj.weight"] == ("mlp", "embed")


def test_a_mixer_no_rule_names_is_kept_whole_and_experts_keep_their_names() -> None:
    """MiniMax's linear attention (qkv_proj, out_proj, output_gate), which its plan leaves out."""
    axes = build("minimax")().axes
    attention = "model.layers.1.self_attn."
    assert axes[attention + "qkv_proj.weight"] == ("embed", "embed")
    assert axes[attention + "out_proj.weight"] == ("embed", "embed")
    assert axes["model.layers.0.self_attn.q_proj.weight"] == ("heads", "embed")


def test_a_param_without_a_rule_inside_a_sharded_attention_stays_unnamed() -> None:
    """DiffLlama's lambdas act on the rank's heads: no rule, so tensor_parallel refuses them."""
    axes = build("diffllama")().axes
    assert axes["model.layers.0.self_attn.lambda_q1"] == (None,)
    assert axes["model.layers.0.self_attn.q_proj.weight"] == ("heads", "embed")


def _place(family: str) -> None:
    model = build(family)()
    step = d9d.tensor_parallel(d9d.make_mesh("cpu", tp=2))(lambda p, s, b: (p, s, {}))
    step.place(model.params, (), model=model)


def test_a_mixer_kept_whole_is_refused_under_sequence_parallelism_with_the_fix() -> None:
    """Under sequence parallelism a kept-whole convolution would see S / tp positions."""
    with pytest.raises(
        RankFailedError,
        match=r"module 'model.layers.0.conv' holds 'model.layers.0.conv.conv.weight' whole on "
        r"'tp' .* or use tensor_parallel\(\.\.\., sequence_parallel=False\)",
    ):
        run_on_ranks(_place, 2, "lfm3")


def test_an_embedding_with_a_norm_of_its_own_is_kept_whole() -> None:
    """Inkling's normed embedding: vocab-parallel, its norm would see the rank's rows only."""
    axes = build("inkling_text")().axes
    assert axes["model.embed_tokens.weight"] == ("embed", "embed")
    assert axes["lm_head.weight"] == ("embed", "embed")  # its plan: rowwise_split_input


def test_dory_keeps_its_sub_normed_attention_and_mlp_whole_and_shards_its_head() -> None:
    """Dory's attn_sub_norm and ffn_sub_norm (no weight) span all heads and channels: whole;
    its head's per-token logit_scale is read beside the rank's vocab shard."""
    axes = build("dory")().axes
    assert axes["model.layers.0.self_attn.q_proj.weight"] == ("embed", "embed")
    assert axes["model.layers.0.mlp.gate_proj.weight"] == ("embed", "embed")
    assert axes["model.layers.0.mlp.suv_gate"] == ("embed",)
    assert axes["model.layers.0.lambda_1"] == ("embed",)
    assert axes["lm_head.weight"] == ("vocab", "embed")
    assert axes["lm_head.logit_scale"] == ("vocab",)
