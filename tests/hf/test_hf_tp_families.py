"""Families whose tp plans name part of what tensor_parallel needs, under ``tp=2`` against one
device (float64, 3 AdamW steps, 2 thread ranks, sequence parallelism): each test covers one
path of ``d9d.hf`` and ``tensor_parallel`` that the family sweep (``sweep.py``) found missing."""

from __future__ import annotations

import pytest
import torch
from equivalence import assert_equivalent, reference
from hf_families import data
from sweep import _LAYOUTS as LAYOUTS
from sweep import build, float64_islands, run_cell

import d9d

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")


def test_sinks_the_plan_names_colwise_are_the_ranks_heads() -> None:
    """Granite-SWA's plan says ``self_attn: local_params`` and ``self_attn.sinks: colwise``:
    the param's own entry wins, so each rank's attention adds its 3 heads' sinks."""
    axes = build("granite_swa")().axes
    assert axes["model.layers.0.self_attn.sinks"] == ("heads",)
    assert run_cell("granite_swa", "tp=2").result == "equal"


def test_latent_attention_down_projections_are_replicated_with_summed_grads() -> None:
    """DeepSeek-V3's plan names no attention param: q_a/kv_a are latent (replicated, read by
    the rank's heads only, grads summed), q_b/kv_b column-parallel over heads. Its norms and
    softmax round to float32, so the cell is exact with those casts kept float64."""
    axes = build("deepseek_v3")().axes
    layer = "model.layers.0.self_attn."
    assert axes[layer + "q_a_proj.weight"] == ("latent", "embed")
    assert axes[layer + "kv_a_layernorm.weight"] == ("latent",)
    assert axes[layer + "kv_b_proj.weight"] == ("heads", "latent")
    cell = run_cell("deepseek_v3", "tp=2")
    assert cell.result == "equal~ (f64)", cell


def test_moe_blocks_that_flatten_tokens_gather_their_shared_experts_input_over_tokens() -> None:
    """Qwen2-MoE's sparse block (declared position-wise) views its input as ``[tokens, H]``
    before the shared expert, whose region then gathers the rank's tokens (dim 0): it used
    to gather dim 1 and crash (``mat1 and mat2 shapes cannot be multiplied (16x96 ...)``)."""
    axes = build("qwen2_moe")().axes
    assert axes["model.layers.0.mlp.shared_expert.gate_proj.weight"] == ("mlp", "embed")
    assert run_cell("qwen2_moe", "tp=2").result == "equal"


def test_float64_islands_put_back_what_they_widen() -> None:
    x = torch.ones(2, dtype=torch.float64)
    with float64_islands():
        assert x.to(torch.float32).dtype == x.float().dtype == torch.float64
        assert torch.nn.functional.softmax(x, 0, dtype=torch.float32).dtype == torch.float64
    assert x.to(torch.float32).dtype == x.float().dtype == torch.float32
    assert d9d.hf.IMPLEMENTED_STYLES["mla_kv_a_proj"]


def test_activation_scalars_on_the_mlp_shard_have_their_grads_summed_without_sp() -> None:
    """Apertus's xIELU scalars scale each rank's shard of the mlp: their grads are partial
    sums over tp in both modes (``mlp_scale``). Kept whole with ``("embed",)`` they equal one
    device with sequence parallelism (whose replicated grads are summed anyway) but were off
    by rel 0.49 without it."""
    assert build("apertus")().axes["model.layers.0.mlp.act_fn.alpha_p"] == ("mlp_scale",)
    mesh_axes, transforms = LAYOUTS["tp=2 no sp"]
    make = build("apertus")
    assert_equivalent(
        make, transforms, mesh_axes, data(2), reference(make, data(2)), dtype=torch.float64
    )
