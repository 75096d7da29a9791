"""The d9d MoE decoder: presets, logical axes, forward and its training step."""

from __future__ import annotations

import re

import pytest
import torch

import d9d
from d9d.errors import ConfigError
from d9d.models import MoE, MoEConfig
from d9d.models.moe import make_train_step


@pytest.mark.parametrize(
    ("name", "total"),
    [
        ("olmoe-1b-7b", 6_919_161_856),  # OLMoE-1B-7B-0924: 6.9B
        ("qwen3-30b-a3b", 30_532_122_624),  # Qwen3-30B-A3B: 30.5B
    ],
)
def test_preset_param_counts(name: str, total: int) -> None:
    config = MoEConfig.preset(name)
    assert config.num_params == total
    model = MoE(config, device="meta")
    assert sum(p.numel() for p in model.parameters()) == total


def test_deepseek_v3_preset_shapes_on_meta() -> None:
    config = MoEConfig.preset("deepseek-v3")
    model = MoE(config, device="meta")
    experts = model.layers[3].mlp.experts
    assert experts.w_gate.shape == (256, 7168, 2048)
    assert model.layers[2].mlp.w_gate.weight.shape == (18_432, 7168)  # dense
    assert model.layers[3].mlp.shared.w_gate.weight.shape == (2048, 7168)
    assert sum(p.numel() for p in model.parameters()) == config.num_params


def test_every_param_matches_exactly_one_axes_rule() -> None:
    model = MoE(MoEConfig.tiny(qk_norm=True))
    rules = list(MoE.logical_axes) + [
        r"\.mlp\." + p.lstrip("^") for p in model.layers[1].mlp.logical_axes
    ]
    for path, _ in model.named_parameters():
        hits = [r for r in rules if re.search(r, path)]
        assert len(hits) == 1, (path, hits)
    axes = d9d.functionalize(model).axes
    assert axes["layers.1.mlp.experts.w_gate"] == ("experts", "embed", "expert_mlp")
    assert axes["layers.1.mlp.router.weight"] == ("experts", "embed")
    assert axes["layers.0.mlp.w_gate.weight"] == ("mlp", "embed")


def test_forward_and_init_are_deterministic() -> None:
    config = MoEConfig.tiny(qk_norm=True, head_dim=8)
    a, b = MoE(config), MoE(config, device="meta").to_empty(device="cpu")
    b.init_weights()
    tokens = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    out_a, out_b = a(tokens), b(tokens)
    assert torch.equal(out_a.logits, out_b.logits)
    assert out_a.logits.shape == (2, 11, 256)
    assert list(out_a.expert_load) == ["layers.1.mlp"]
    assert out_a.expert_load["layers.1.mlp"].sum().item() == 2 * 11 * 2
    assert out_a.aux_loss.item() > 0


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(n_dense_layers=3), "n_dense_layers=3 must be in"),
        (dict(dim=32), "moe.dim=64 must equal dim=32"),
        (dict(n_kv_heads=3), "n_heads=4 must be divisible by n_kv_heads=3"),
        (dict(qk_norm="heads"), "qk_norm='heads' must be False, True"),
        (dict(qk_norm=1), "qk_norm=1 must be False, True"),
        # head_dim=0 was read as None (dim // n_heads = 16); the others were not checked at all
        (dict(head_dim=0), "MoEConfig.head_dim must be a positive int, got head_dim=0."),
        (dict(head_dim=-8), "MoEConfig.head_dim must be a positive int, got head_dim=-8."),
        (dict(head_dim=8.0), "MoEConfig.head_dim must be a positive int, got head_dim=8.0."),
        (dict(rope_theta=0.0), "MoEConfig.rope_theta must be a finite positive number, got"),
        (dict(rope_theta=float("nan")), "rope_theta must be a finite positive number, got rope"),
        (dict(norm_eps=-1.0), "MoEConfig.norm_eps must be a finite positive number, got norm"),
        (dict(init_std=-1.0), "MoEConfig.init_std must be a finite positive number, got init"),
        (dict(seed="x"), "MoEConfig.seed must be an int, got seed='x'."),
    ],
)
def test_config_errors(fields: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(match)):
        MoEConfig.tiny(**fields)


def test_unknown_preset_is_named() -> None:
    with pytest.raises(ConfigError, match="Unknown MoE preset name='huge'"):
        MoEConfig.preset("huge")


def test_train_step_learns_and_moves_the_bias_functionally() -> None:
    model = d9d.functionalize(MoE(MoEConfig.tiny()))
    opt = d9d.optim.adamw(1e-2, weight_decay=0.1)
    step = make_train_step(model, opt, grad_norm=True)
    params = {k: v.clone() for k, v in model.params.items()}
    state = opt.init(params)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    key = "layers.1.mlp.router.expert_bias"
    first = None
    for _ in range(4):
        before = params[key].clone()
        out = model.apply(params, batch["tokens"])  # the load the step will see
        new, state, metrics = step(params, state, batch)
        assert torch.equal(params[key], before)  # the step did not write into its input
        load = out.expert_load["layers.1.mlp"]
        torch.testing.assert_close(new[key], before + 1e-3 * torch.sign(load.mean() - load))
        assert metrics["load_balance"].item() == pytest.approx((load.max() / load.mean()).item())
        first = metrics["loss"] if first is None else first
        params = new
    assert metrics["loss"] < first
    assert metrics["aux_loss"] > 0


# OLMoE's q/k norms span all heads, so tensor_parallel refuses it (and it plans on fsdp alone):
# tests/models/moe/test_moe_hf_architectures.py.
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_large_presets_plan_on_a_simulated_mesh(name: str) -> None:
    """On 32 fake ranks (fsdp=8 x tp=4) the routed experts are sharded over fsdp only."""
    from torch.distributed.tensor import Replicate, Shard

    from d9d.testing import fake_world

    with fake_world(32), torch.device("meta"):
        mesh = d9d.make_mesh("cpu", fsdp=8, tp=4)
        model = d9d.functionalize(MoE(MoEConfig.preset(name)))
        step = d9d.tensor_parallel(mesh)(d9d.shard_params(mesh)(lambda p, s, b: (p, s, {})))
        plan = step.make_plan(model.params, model.axes)
    layer = MoEConfig.preset(name).n_dense_layers
    experts = plan.entries[f"layers.{layer}.mlp.experts.w_gate"]
    assert experts.storage == (Shard(0), Replicate())
    wq = plan.entries[f"layers.{layer}.attn.wq.weight"]
    assert Shard(0) in wq.storage and len(set(wq.storage)) == 2  # sharded over both axes
    assert plan.total_bytes() == MoEConfig.preset(name).num_params * 4


@pytest.mark.parametrize("qk_norm", [True, "full"])
def test_an_empty_batch_gives_empty_logits_and_no_aux_loss(qk_norm: bool | str) -> None:
    """Raised ``cannot reshape tensor of 0 elements`` in the attention's views."""
    out = MoE(MoEConfig.tiny(qk_norm=qk_norm))(torch.zeros(2, 0, dtype=torch.long))
    assert out.logits.shape == (2, 0, 256)
    assert out.aux_loss.item() == 0.0
    assert not out.expert_load["layers.1.mlp"].any()
