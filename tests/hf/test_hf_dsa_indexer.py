"""The top-k indexer of DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-MoE-DSA, AXK2,
Dots3-Note) under ``tp=2``: a child of the head-sharded attention whose forward runs under
``torch.no_grad()``, it is kept whole on every tp rank, computed on the attention's whole input
(and the whole ``q_a_layernorm`` output), so every rank picks one device's top-k keys, and its
params get no grad from the loss on either side."""

from __future__ import annotations

import pytest
import torch
from equivalence import assert_equivalent, reference
from hf_families import data
from sweep import _LAYOUTS as LAYOUTS
from sweep import build, float64_islands

import d9d
from d9d.testing import run_on_ranks

pytestmark = pytest.mark.distributed
pytest.importorskip("transformers")

FAMILY = "deepseek_v32"
INDEXER = "model.layers.0.self_attn.indexer."


def test_the_indexer_is_kept_whole_inside_the_head_sharded_attention() -> None:
    axes = build(FAMILY)().axes
    assert axes[INDEXER + "wq_b.weight"] == ("embed", "embed")
    assert axes[INDEXER + "weights_proj.weight"] == ("embed", "embed")
    assert axes[INDEXER + "k_norm.weight"] == ("embed",)
    assert axes["model.layers.0.self_attn.q_b_proj.weight"] == ("heads", "embed")
    assert axes["model.layers.0.self_attn.q_a_proj.weight"] == ("latent", "embed")


def _indexer_grads(grads: dict) -> dict[str, torch.Tensor]:
    return {k: g for k, g in grads.items() if ".indexer." in k}


def _loss_fn(model: d9d.Model):
    def loss_fn(params, batch):
        logits = model.apply(params, batch["tokens"]).logits
        return d9d.losses.cross_entropy(logits, batch["labels"])

    return loss_fn


def _tp_indexer_grads(batch: dict) -> dict[str, torch.Tensor]:
    model = build(FAMILY)()
    loss_fn = _loss_fn(model)

    def step(params, opt_state, batch):
        _, grads = d9d.value_and_grad(loss_fn)(params, batch)
        return params, opt_state, _indexer_grads(grads)

    step = d9d.tensor_parallel(d9d.make_mesh("cpu", tp=2))(step)
    params, state = step.place(model.params, (), model=model)
    _, _, grads = step(params, state, step.shard_batch(batch))
    return {k: g.full_tensor() if hasattr(g, "full_tensor") else g for k, g in grads.items()}


def test_the_indexer_gets_no_grad_on_one_device_nor_under_tp() -> None:
    """Its top-k indices carry no grad: its params' grads are exactly zero on both sides."""
    batch = data(1)[0]
    model = build(FAMILY)()
    _, grads = d9d.value_and_grad(_loss_fn(model))(model.params, batch)
    one_device = _indexer_grads(grads)
    assert len(one_device) == 2 * 5  # wq_b, wk, k_norm (2), weights_proj in 2 layers
    for ranks in (run_on_ranks(_tp_indexer_grads, 2, batch), [one_device]):
        for found in ranks:
            assert set(found) == set(one_device)
            for key, grad in found.items():
                assert torch.count_nonzero(grad) == 0, key


def test_tp_equals_one_device_with_the_indexer_whole() -> None:
    """3 AdamW steps, sequence parallelism on, float64 with ``transformers``' float32 casts
    kept float64 (its MoE router and the indexer's scores): rel 1e-9 of one device."""
    make = build(FAMILY)
    mesh_axes, transforms = LAYOUTS["tp=2"]
    with float64_islands():
        expected = reference(make, data())
        assert_equivalent(make, transforms, mesh_axes, data(), expected, dtype=torch.float64)
