"""The MoE decoder's training step under ``shard_params``, ``tensor_parallel``,
``context_parallel``, ``pipeline`` and ``d9d.jit`` equals the same step on one device
(float64, 5 AdamW steps, aux losses and the bias on, unevenly ignored labels); with
microbatches, the microbatch accumulation written out on one device."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch
from moe_steps import (
    METRICS,
    PARAM_TOL,
    TOL,
    accumulated_reference,
    batches,
    optimizer,
    reference,
    trained,
)

import d9d
from d9d.errors import RankFailedError
from d9d.models import MoE, MoEConfig
from d9d.models.moe import make_train_step
from d9d.testing import assert_trees_all_close, run_on_ranks


def _model(axes: dict | None = None, **overrides: object) -> d9d.Model:
    return d9d.functionalize(MoE(MoEConfig.tiny(**overrides)).to(torch.float64), axes=axes)


@functools.cache
def _reference(**overrides: int):
    return reference(lambda: _model(**overrides))


@functools.cache
def _accumulated_reference(microbatches: int, data_ranks: int = 1, **overrides: int):
    return accumulated_reference(lambda: _model(**overrides), microbatches, data_ranks)


def _pipeline(**options):
    return lambda mesh: [d9d.pipeline(mesh, "pp", **options)]


# Both blocks MoE, so that each of two pipeline stages holds an MoE layer whose aux loss's
# gradient crosses the boundary.
ALL_MOE = {"n_dense_layers": 0}


# (layout, transforms, model overrides)
def _capped(n_shared_experts: int) -> dict:
    moe = MoEConfig.tiny().moe
    return {"moe": replace(moe, capacity_factor=1.0, n_shared_experts=n_shared_experts)}


LAYOUTS = {
    "fsdp=2": ({"fsdp": 2}, lambda mesh: [d9d.shard_params(mesh, axis="fsdp")], {}),
    # Under tp=2 the shared experts are column/row-parallel and the routed experts whole;
    # with sequence parallelism (the default) each rank routes its half of every sequence.
    "tp=2": ({"tp": 2}, lambda mesh: [d9d.tensor_parallel(mesh, axis="tp")], {}),
    "tp=2 no sp": (
        {"tp": 2},
        lambda mesh: [d9d.tensor_parallel(mesh, axis="tp", sequence_parallel=False)],
        {},
    ),
    "fsdp=2 x tp=2": (
        {"fsdp": 2, "tp": 2},
        lambda mesh: [d9d.shard_params(mesh, axis="fsdp"), d9d.tensor_parallel(mesh, axis="tp")],
        {},
    ),
    # A capped layer runs on whole sequences; its shared experts stay whole beside it.
    "tp=2 no sp, capped with shared experts": (
        {"tp": 2},
        lambda mesh: [d9d.tensor_parallel(mesh, axis="tp", sequence_parallel=False)],
        _capped(1),
    ),
    "cp=2": ({"cp": 2}, lambda mesh: [d9d.context_parallel(mesh, axis="cp")], {}),
    "fsdp=2 x cp=2": (
        {"fsdp": 2, "cp": 2},
        lambda mesh: [d9d.shard_params(mesh, axis="fsdp"), d9d.context_parallel(mesh)],
        {},
    ),
    "pp=2 gpipe, 1 microbatch": (
        {"pp": 2},
        _pipeline(schedule="gpipe", microbatches=1),
        ALL_MOE,
    ),
}

# (layout, microbatches, transforms, model overrides); interleaved: 4 stages, the first dense.
MICROBATCHED = {
    "fsdp=2, 2 microbatches": (
        {"fsdp": 2},
        2,
        lambda mesh: [d9d.shard_params(mesh, axis="fsdp", microbatches=2)],
        ALL_MOE,
    ),
    "pp=2 1f1b, 4 microbatches": (
        {"pp": 2},
        4,
        _pipeline(schedule="1f1b", microbatches=4),
        ALL_MOE,
    ),
    "pp=2 x fsdp=2 1f1b, 2 microbatches": (
        {"pp": 2, "fsdp": 2},
        2,
        lambda mesh: [
            d9d.shard_params(mesh, axis="fsdp"),
            d9d.pipeline(mesh, "pp", schedule="1f1b", microbatches=2),
        ],
        ALL_MOE,
    ),
    "pp=2 interleaved_1f1b, 2 microbatches": (
        {"pp": 2},
        2,
        _pipeline(schedule="interleaved_1f1b", microbatches=2, virtual_stages=2),
        {"n_layers": 4, "n_dense_layers": 1},
    ),
}


def _rank(mesh_axes: dict[str, int], transforms, overrides: dict[str, int]):
    mesh = d9d.make_mesh("cpu", **mesh_axes)
    model, opt = _model(**overrides), optimizer()
    step = make_train_step(model, opt)
    for transform in transforms(mesh):
        step = transform(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    return trained(step, params, state)


def _assert_ranks_equal(ranks, want_metrics, want_params) -> None:
    for metrics, params in ranks:
        torch.testing.assert_close(metrics, want_metrics, **TOL)
        assert_trees_all_close(params, {k: want_params[k] for k in params}, **PARAM_TOL)
    assert set().union(*(params for _, params in ranks)) == set(want_params)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_transformed_step_equals_one_device(name: str) -> None:
    """Metrics (cross entropy, aux loss, load balance) and every param, the router bias
    included, equal one device's; under a pipeline each rank holds its stage's params."""
    mesh_axes, transforms, overrides = LAYOUTS[name]
    want_metrics, want_params = _reference(**overrides)
    bias = "layers.1.mlp.router.expert_bias"
    assert want_params[bias].abs().sum() > 0  # the bias moved
    method = "fork" if "pp" in mesh_axes else "thread"  # threads have no point-to-point ops
    world = math.prod(mesh_axes.values())
    ranks = run_on_ranks(_rank, world, mesh_axes, transforms, overrides, method=method, timeout=300)
    _assert_ranks_equal(ranks, want_metrics, want_params)


def test_each_microbatch_balances_its_own_tokens() -> None:
    """The accumulated reference is another objective than the whole batch's: the first
    step's cross entropy is the same (same params, the global token mean), its aux loss is
    the microbatches' own, and so every later step differs."""
    accumulated, _ = _accumulated_reference(2, 2, **ALL_MOE)
    whole_batch, _ = _reference(**ALL_MOE)
    torch.testing.assert_close(accumulated[0, 0], whole_batch[0, 0], **TOL)
    assert not torch.isclose(accumulated[0, 1], whole_batch[0, 1], rtol=1e-3)
    assert not torch.isclose(accumulated[1:, 0], whole_batch[1:, 0], **TOL).any()


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(MICROBATCHED))
def test_microbatched_step_equals_one_device_accumulating(name: str) -> None:
    """With microbatches the step equals the accumulation written out on one device."""
    mesh_axes, microbatches, transforms, overrides = MICROBATCHED[name]
    data_ranks = mesh_axes.get("fsdp", 1)
    want_metrics, want_params = _accumulated_reference(microbatches, data_ranks, **overrides)
    method = "fork" if "pp" in mesh_axes else "thread"
    world = math.prod(mesh_axes.values())
    ranks = run_on_ranks(_rank, world, mesh_axes, transforms, overrides, method=method, timeout=300)
    _assert_ranks_equal(ranks, want_metrics, want_params)


def _traffic_rank() -> tuple[dict, dict]:
    mesh = d9d.make_mesh("cpu", pp=2)
    model, opt = _model(**ALL_MOE), optimizer()
    step = d9d.pipeline(mesh, "pp", schedule="1f1b", microbatches=2)(make_train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    comms = step.comms(params, state, batches()[0])
    return dict(comms.count), dict(comms.bytes)


@pytest.mark.distributed
def test_stages_pass_the_state_of_the_blocks() -> None:
    """pp=2, 2 microbatches of 4 x 16 tokens, float64: per microbatch each boundary carries
    the residual stream [4, 16, 64], the aux loss so far (0-d float64) and the loads [2, 6]
    (float32) forward, and a grad of each back; no collective beyond the loss's and the
    clipping norm's all-reduce, and the broadcast of the aux outputs from the last stage as
    a Python object (``broadcast_object_list``: the pickle's length, then the pickle), which
    ``step.comms`` once missed."""
    state = 4 * 16 * 64 * 8 + 8 + 2 * 6 * 4
    results = run_on_ranks(_traffic_rank, 2, method="fork", timeout=300)
    for count, nbytes in results:
        assert count == {
            ("send", "pp"): 6,
            ("recv", "pp"): 6,
            ("all_reduce", "pp"): 2,
            ("broadcast", "pp"): 2,
        }
        assert nbytes[("send", "pp")] == nbytes[("recv", "pp")] == 2 * state
        assert nbytes[("broadcast", "pp")] > 8
    assert results[0][1] == results[1][1]


def _place_rank(sequence_parallel: bool, axes: dict | None = None, **overrides: object) -> None:
    mesh = d9d.make_mesh("cpu", tp=2)
    model, opt = _model(axes, **overrides), optimizer()
    tp = d9d.tensor_parallel(mesh, axis="tp", sequence_parallel=sequence_parallel)
    step = tp(make_train_step(model, opt))
    step.place(model.params, opt.init(model.params), model=model)


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


# Shared experts sharded over tp like a dense MLP's, which a capped layer does not declare.
SHARDED_SHARED = {
    r"\.shared\.w_(gate|up)\.weight$": ("mlp", "embed"),
    r"\.shared\.w_down\.weight$": ("embed", "mlp"),
}


def test_a_capped_layer_keeps_its_shared_experts_whole() -> None:
    axes = _model(**_capped(1)).axes
    assert axes["layers.1.mlp.shared.w_gate.weight"] == ("expert_mlp", "embed")
    assert axes["layers.1.mlp.shared.w_down.weight"] == ("embed", "expert_mlp")
    assert _model(**ALL_MOE).axes["layers.0.mlp.shared.w_gate.weight"] == ("mlp", "embed")


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
        run_on_ranks(_place_rank, 2, sequence_parallel, SHARDED_SHARED, **_capped(1), timeout=120)


def _comms_rank(sequence_parallel: bool):
    mesh = d9d.make_mesh("cpu", tp=2)
    model, opt = _model(), optimizer()
    tp = d9d.tensor_parallel(mesh, axis="tp", sequence_parallel=sequence_parallel)
    step = tp(make_train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    return step.comms(params, state, batches()[0])


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
    model, opt = _model(**small), optimizer()
    step = d9d.jit(make_train_step(model, opt), backend="aot_eager", fail_on_recompile=True)
    params = {k: v.clone() for k, v in model.params.items()}
    state, metrics, loads = opt.init(params), [], []
    for batch in batches():
        loads.append(model.apply(params, batch["tokens"]).expert_load["layers.0.mlp"])
        params, state, m = step(params, state, batch)
        metrics.append(torch.stack([m[k] for k in METRICS]))
    assert len({tuple(load.tolist()) for load in loads}) > 1  # the routing changed
    torch.testing.assert_close(torch.stack(metrics), want_metrics, **TOL)
    assert_trees_all_close(params, want_params, **TOL)
