"""The MoE decoder's training step under ``shard_params``, ``tensor_parallel`` and ``d9d.jit``
equals the same step on one device (float64, 5 AdamW steps, aux losses and the bias on)."""

from __future__ import annotations

import pytest
import torch

import d9d
from d9d.errors import RankFailedError
from d9d.models import MoE, MoEConfig
from d9d.models.moe import make_train_step
from d9d.testing import assert_trees_all_close, run_on_ranks

STEPS = 5
TOL = {"rtol": 1e-9, "atol": 1e-12}
METRICS = ("loss", "aux_loss", "load_balance")


def _model(**overrides: int) -> d9d.Model:
    return d9d.functionalize(MoE(MoEConfig.tiny(**overrides)).to(torch.float64))


def _optimizer() -> d9d.optim.GradientTransformation:
    schedule = d9d.optim.warmup_cosine(1e-2, 1, 10, init_value=1e-3)
    return d9d.optim.chain(d9d.optim.clip_by_global_norm(0.5), d9d.optim.adamw(schedule))


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 256, (8, 17), generator=g) for _ in range(STEPS)]
    return [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens]


def _reference(**overrides: int):
    model, opt = _model(**overrides), _optimizer()
    step = make_train_step(model, opt)
    params = {k: v.clone() for k, v in model.params.items()}
    state, metrics = opt.init(params), []
    for batch in _batches():
        params, state, m = step(params, state, batch)
        metrics.append(torch.stack([m[k] for k in METRICS]))
    return torch.stack(metrics), params


def _transform(step, mesh, transform: str):
    match transform:
        case "shard_params":
            return d9d.shard_params(mesh, axis="fsdp")(step)
        case "tensor_parallel":
            return d9d.tensor_parallel(mesh, axis="tp")(step)
        case "tensor_parallel no sp":
            return d9d.tensor_parallel(mesh, axis="tp", sequence_parallel=False)(step)
        case "shard_params+tensor_parallel":
            return d9d.shard_params(mesh, axis="fsdp")(d9d.tensor_parallel(mesh, axis="tp")(step))
        case _:
            raise ValueError(transform)


def _rank(mesh_axes: dict[str, int], transform: str):
    mesh = d9d.make_mesh("cpu", **mesh_axes)
    model, opt = _model(), _optimizer()
    step = _transform(make_train_step(model, opt), mesh, transform)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    metrics = []
    for batch in _batches():
        params, state, m = step(params, state, step.shard_batch(batch))
        metrics.append(torch.stack([m[k] for k in METRICS]))
    return torch.stack(metrics), {k: v.full_tensor() for k, v in params.items()}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("mesh_axes", "transform"),
    [
        ({"fsdp": 2}, "shard_params"),
        ({"tp": 2}, "tensor_parallel"),
        ({"tp": 2}, "tensor_parallel no sp"),
        ({"fsdp": 2, "tp": 2}, "shard_params+tensor_parallel"),
    ],
    ids=["fsdp=2", "tp=2", "tp=2 no sp", "fsdp=2 x tp=2"],
)
def test_transformed_step_equals_one_device(mesh_axes: dict, transform: str) -> None:
    """Under tp=2 the shared experts are column/row-parallel and the routed experts whole;
    with sequence parallelism (the default) each rank routes its half of every sequence."""
    want_metrics, want_params = _reference()
    bias = "layers.1.mlp.router.expert_bias"
    assert want_params[bias].abs().sum() > 0  # the bias moved
    world = 1
    for size in mesh_axes.values():
        world *= size
    for metrics, params in run_on_ranks(_rank, world, mesh_axes, transform, timeout=300):
        torch.testing.assert_close(metrics, want_metrics, **TOL)
        assert_trees_all_close(params, want_params, **TOL)


def _sequence_parallel_rank() -> None:
    mesh = d9d.make_mesh("cpu", tp=2)
    model, opt = _model(), _optimizer()
    step = d9d.tensor_parallel(mesh, axis="tp")(make_train_step(model, opt))
    step.place(model.params, opt.init(model.params), model=model)


@pytest.mark.distributed
def test_sequence_parallelism_over_the_replicated_experts_is_named() -> None:
    with pytest.raises(RankFailedError, match=r"PlanError: module 'layers\.1\.mlp' holds .*'tp'"):
        run_on_ranks(_sequence_parallel_rank, 2, timeout=120)


@pytest.mark.compile
def test_jit_one_graph_for_steps_whose_routing_differs() -> None:
    small = {"n_layers": 1, "n_dense_layers": 0}  # one MoE block: a third of the compile time
    want_metrics, want_params = _reference(**small)
    model, opt = _model(**small), _optimizer()
    step = d9d.jit(make_train_step(model, opt), backend="aot_eager", fail_on_recompile=True)
    params = {k: v.clone() for k, v in model.params.items()}
    state, metrics, loads = opt.init(params), [], []
    for batch in _batches():
        loads.append(model.apply(params, batch["tokens"]).expert_load["layers.0.mlp"])
        params, state, m = step(params, state, batch)
        metrics.append(torch.stack([m[k] for k in METRICS]))
    assert len({tuple(load.tolist()) for load in loads}) > 1  # the routing changed
    torch.testing.assert_close(torch.stack(metrics), want_metrics, **TOL)
    assert_trees_all_close(params, want_params, **TOL)
