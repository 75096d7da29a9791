"""The MoE decoder's training step under ``shard_params``, ``tensor_parallel`` and ``d9d.jit``
equals the same step on one device (float64, 5 AdamW steps, aux losses and the bias on)."""

from __future__ import annotations

import functools
from dataclasses import replace

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


@functools.cache
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


def _place_rank(sequence_parallel: bool, **overrides: object) -> None:
    mesh = d9d.make_mesh("cpu", tp=2)
    model, opt = _model(**overrides), _optimizer()
    tp = d9d.tensor_parallel(mesh, axis="tp", sequence_parallel=sequence_parallel)
    step = tp(make_train_step(model, opt))
    step.place(model.params, opt.init(model.params), model=model)


def _capped(n_shared_experts: int) -> dict:
    moe = MoEConfig.tiny().moe
    return {"moe": replace(moe, capacity_factor=1.0, n_shared_experts=n_shared_experts)}


@pytest.mark.distributed
def test_a_capped_layer_is_not_position_wise_so_sequence_parallelism_refuses_it() -> None:
    """With a capacity the tokens of one call compete for the experts: the layer does not
    declare itself position-wise, and runs on whole sequences only."""
    assert MoE(MoEConfig.tiny(**_capped(0))).layers[1].mlp.position_wise is False
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: module 'layers\.1\.mlp' holds 'layers\.1\.mlp\.router\.weight' "
        r"whole on 'tp' and no sharded nn\.Linear",
    ):
        run_on_ranks(_place_rank, 2, True, **_capped(0), timeout=120)
    run_on_ranks(_place_rank, 2, False, **_capped(0), timeout=120)


@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_shared_experts_sharded_beside_a_capped_layer_are_refused(sequence_parallel: bool) -> None:
    """Given its input whole, the capped layer's input grad would be summed over tp, the
    routed experts' part of it included: refused, with or without sequence parallelism."""
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: module 'layers\.1\.mlp' holds column-parallel linears and "
        r"'layers\.1\.mlp\.router\.weight' whole on 'tp': tensor_parallel gives the module its "
        r"input whole and sums its input grad over 'tp'",
    ):
        run_on_ranks(_place_rank, 2, sequence_parallel, **_capped(1), timeout=120)


def _comms_rank(sequence_parallel: bool):
    mesh = d9d.make_mesh("cpu", tp=2)
    model, opt = _model(), _optimizer()
    tp = d9d.tensor_parallel(mesh, axis="tp", sequence_parallel=sequence_parallel)
    step = tp(make_train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    return step.comms(params, state, _batches()[0])


@pytest.mark.distributed
def test_sequence_parallel_moves_the_analytic_bytes() -> None:
    """tiny (block 0 dense, block 1 MoE), batch 8 x 16, float64. The shared experts are one
    more tensor-parallel MLP: an all-gather in and a reduce-scatter out, forward and backward
    mirrored. With sequence parallelism each rank routes its 8 x 8 positions, so beyond the
    dense model's all-reduces (embedding, 3 loss values per token, 5 norm grads, the
    clipping's 26 per-param norms) the MoE layer all-reduces its counts (E + 1 float32) and
    its aux loss (one float64) in the forward, and the grads of the router and of the routed
    experts, whole on tp and computed on half the tokens, in the backward. Without sequence
    parallelism none of those: every rank routes every token and the expert grads are whole;
    the shared experts all-reduce their output and their input grad instead."""
    config = MoEConfig.tiny()
    batch, seq, dim, item = 8, 16, config.dim, 8
    experts, width = config.moe.n_experts, config.moe.expert_dim
    act = batch * seq * dim * item
    regions = 4  # attention and MLP of block 0, attention and shared experts of block 1
    clip = 26 * item
    sp, no_sp = (run_on_ranks(_comms_rank, 2, mode)[0] for mode in (True, False))
    assert sp.count[("all_gather", "tp")] == 2 * regions + 2  # + the head, + the slice's grad
    assert sp.bytes[("all_gather", "tp")] == (2 * regions + 2) * act
    assert sp.count[("reduce_scatter", "tp")] == 2 * regions + 1  # + the head's input grad
    assert sp.bytes[("reduce_scatter", "tp")] == (2 * regions + 1) * act
    dense = act + 3 * batch * seq * item + 5 * dim * item + clip
    moe = (experts + 1) * 4 + item + experts * dim * item + 3 * experts * dim * width * item
    assert sp.count[("all_reduce", "tp")] == 1 + 3 + 5 + 1 + (2 + 4)
    assert sp.bytes[("all_reduce", "tp")] == dense + moe
    assert set(sp.count) == {("all_gather", "tp"), ("reduce_scatter", "tp"), ("all_reduce", "tp")}
    assert no_sp.count[("all_reduce", "tp")] == 1 + 2 * regions + 1 + 3 + 1
    assert (
        no_sp.bytes[("all_reduce", "tp")] == (2 + 2 * regions) * act + 3 * batch * seq * item + clip
    )
    assert set(no_sp.count) == {("all_reduce", "tp")}


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
