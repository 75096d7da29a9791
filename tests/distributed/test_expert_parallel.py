"""``expert_parallel`` against one device: the MoE decoder's training step (float64, 5 AdamW
steps with clipping, aux loss, z-loss and the bias on, unevenly ignored labels) under
``ep=2``, ``ep=4``, ``ep=2 x fsdp=2``, ``ep=2 x tp=2`` and ``ep=2 x cp=2``, routing that
leaves experts empty, ``pp=2 x ep=2`` with 2 microbatches, full and selective remat (which
keeps the all-to-alls' outputs); the plan, the per-rank bytes, the all-to-all bytes of one
step from its routing, and the refusals."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch
from moe_steps import (
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
from d9d.models import Llama, LlamaConfig, MoE, MoEConfig
from d9d.models.moe import make_train_step
from d9d.testing import assert_trees_all_close, run_on_ranks

EXPERTS = "layers.1.mlp.experts.w_gate"


def _config(experts: int = 8) -> MoEConfig:
    config = MoEConfig.tiny()
    moe = replace(config.moe, n_experts=experts)
    return replace(config, moe=moe)


def _model(experts: int = 8, skewed: bool = False) -> d9d.Model:
    model = MoE(_config(experts)).to(torch.float64)
    if skewed:
        # A selection bias that picks experts 0 and 1 for every token in all 5 steps (the
        # bias moves 1e-3 a step): the other experts get no token on any rank.
        with torch.no_grad():
            model.layers[1].mlp.router.expert_bias[:2] = 10.0
    return d9d.functionalize(model)


@functools.cache
def _reference(experts: int, skewed: bool):
    return reference(lambda: _model(experts, skewed))


def _transforms(mesh, mesh_axes: dict[str, int]) -> list:
    transforms = [d9d.expert_parallel(mesh, axis="ep")]
    if "fsdp" in mesh_axes:
        transforms.append(d9d.shard_params(mesh, axis="fsdp"))
    if "tp" in mesh_axes:
        transforms.append(d9d.tensor_parallel(mesh, axis="tp"))
    if "cp" in mesh_axes:
        transforms.append(d9d.context_parallel(mesh, axis="cp"))
    if "pp" in mesh_axes:
        transforms.append(d9d.pipeline(mesh, "pp", schedule="gpipe", microbatches=1))
    if "remat" in mesh_axes:
        transforms.append(d9d.remat("full", mesh=mesh))
    return transforms


def _rank(mesh_axes: dict[str, int], experts: int, skewed: bool):
    mesh = d9d.make_mesh("cpu", **{k: v for k, v in mesh_axes.items() if k != "remat"})
    model, opt = _model(experts, skewed), optimizer()
    step = make_train_step(model, opt)
    for transform in _transforms(mesh, mesh_axes):
        step = transform(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    local = params[EXPERTS].to_local().shape if EXPERTS in params else None
    return *trained(step, params, state), local


LAYOUTS = {
    "ep=2": ({"ep": 2}, 8, False),
    "ep=4": ({"ep": 4}, 8, False),
    "ep=2, 6 experts": ({"ep": 2}, 6, False),
    "ep=2 x fsdp=2": ({"ep": 2, "fsdp": 2}, 8, False),
    "ep=4, skewed routing": ({"ep": 4}, 8, True),
    "ep=2 x tp=2": ({"ep": 2, "tp": 2}, 8, False),
    "ep=2 x cp=2": ({"ep": 2, "cp": 2}, 8, False),
    "ep=2, remat full": ({"ep": 2, "remat": 1}, 8, False),
    # Stage 0 holds the dense block 0, stage 1 the MoE block 1 (whose experts are on ep).
    "pp=2 x ep=2 gpipe, 1 microbatch": ({"pp": 2, "ep": 2}, 8, False),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_step_equals_one_device(name: str) -> None:
    """Metrics and every param (the experts, the router and its bias included) equal one
    device's fed the whole batch; each rank stores E / ep experts (/ fsdp of their width)."""
    mesh_axes, experts, skewed = LAYOUTS[name]
    want_metrics, want_params = _reference(experts, skewed)
    world = math.prod(mesh_axes.values())
    method = "fork" if "pp" in mesh_axes else "thread"  # threads have no point-to-point ops
    ranks = run_on_ranks(_rank, world, mesh_axes, experts, skewed, method=method, timeout=300)
    dim = _config(experts).moe.dim
    for metrics, params, local in ranks:
        torch.testing.assert_close(metrics, want_metrics, **TOL)
        assert_trees_all_close(params, {k: want_params[k] for k in params}, **PARAM_TOL)
        if local is not None:
            assert tuple(local) == (experts // mesh_axes["ep"], dim // mesh_axes.get("fsdp", 1), 40)
    assert set().union(*(params for _, params, _ in ranks)) == set(want_params)
    assert any(local is not None for _, _, local in ranks)


def _shards(batch: dict[str, torch.Tensor], ranks: int) -> list[dict[str, torch.Tensor]]:
    return [{k: v.chunk(ranks)[r] for k, v in batch.items()} for r in range(ranks)]


def test_skewed_routing_leaves_experts_empty() -> None:
    """The skewed model routes no token of any rank to experts 2 to 7."""
    model = _model(8, skewed=True)
    for shard in _shards(batches()[0], 4):
        load = model.apply(model.params, shard["tokens"]).expert_load["layers.1.mlp"]
        assert load[2:].sum() == 0 and load[:2].sum() == shard["tokens"].numel() * 2


def _inspect_rank(ranks: int):
    mesh = d9d.make_mesh("cpu", ep=ranks)
    model, opt = _model(8), optimizer()
    step = d9d.expert_parallel(mesh)(make_train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    batch = step.shard_batch(batches()[0])
    comms = step.comms(params, state, batch)
    return str(step.plan), step.plan.explain(EXPERTS), step.memory(params, state), comms


def _routed_ids(model: d9d.Model, tokens: torch.Tensor) -> torch.Tensor:
    """The top-k expert ids the MoE block routes ``tokens`` with, recorded on one device."""
    layer, seen = model.module.layers[1].mlp, []

    def record(x, expert_ids, weights):
        seen.append(expert_ids)
        return type(layer).dispatch(layer, x, expert_ids, weights)

    layer.dispatch = record
    try:
        model.apply(model.params, tokens)
    finally:
        del layer.dispatch
    return seen[0]


@pytest.mark.distributed
def test_plan_memory_and_all_to_all_bytes() -> None:
    """ep=2, batch 8 x 16 (4 rows per rank), top-2 of 8 experts, dim 64, float64. Per step and
    rank, on 'ep': the counts (per rank: its tokens and its 4 experts' choices, 2 x 5 int64);
    forward, the tokens that leave the rank (each once per destination rank) with their ids
    (2 int32) and weights (2 float64), and one row back per token received; backward, the
    rows' grads out and the tokens' and weights' grads back. Which tokens leave follows from
    the step's routing (each rank's expert ids, recorded on one device)."""
    ranks, experts = 2, 8
    model = _model(experts)
    ids = [_routed_ids(model, shard["tokens"]) for shard in _shards(batches()[0], ranks)]
    config = _config(experts).moe
    row = config.dim * 8
    expert_bytes = sum(v.numel() * 8 for k, v in model.params.items() if ".experts." in k)
    dense_bytes = sum(v.numel() * 8 for k, v in model.params.items() if ".experts." not in k)
    state = optimizer().init(model.params)
    scalars = sum(v.numel() * v.element_size() for v in d9d.tree.leaves(state)) - 2 * (
        expert_bytes + dense_bytes
    )
    for rank, (table, why, memory, comms) in enumerate(run_on_ranks(_inspect_rank, 2, ranks)):
        assert f"{EXPERTS}" in table and "ep:S(0)" in table
        assert "4 of 8 experts per rank of 'ep'" in why and "grads scaled by 1/2" in why
        other = 1 - rank
        sent = int(((ids[rank] // 4) == other).any(1).sum())
        received = int(((ids[other] // 4) == rank).any(1).sum())
        assert 0 < sent < 4 * 16 and 0 < received < 4 * 16
        k = config.top_k
        counts = ranks * (experts // ranks + 1) * 8
        moved = 2 * (sent + received) * row + sent * k * 4 + (sent + received) * k * 8
        assert comms.count[("all_to_all", "ep")] == 8
        assert comms.bytes[("all_to_all", "ep")] == counts + moved
        assert memory.params == dense_bytes + expert_bytes // ranks
        assert memory.opt_state == 2 * memory.params + scalars  # AdamW's two moments


def _refused_rank(kind: str) -> None:
    mesh = d9d.make_mesh(
        "cpu", **{"axis": {"fsdp": 2}, "experts on tp": {"tp": 2}}.get(kind, {"ep": 2})
    )
    if kind == "axis":
        d9d.expert_parallel(mesh, axis="ep")
    if kind == "experts on tp":
        model = _model(experts=8)
        step = d9d.tensor_parallel(mesh, rules={"expert_mlp": "tp"})(lambda p, s, b: (p, s, {}))
        step.place(model.params, (), model=model)
    model = (
        d9d.functionalize(Llama(LlamaConfig.tiny()))
        if kind == "dense"
        else _model(experts=5 if kind == "indivisible" else 8)
    )
    step = d9d.expert_parallel(mesh)(lambda p, s, b: (p, s, {}))
    if kind == "no model":
        step.place(model.params, (), axes=model.axes)
    step.place(model.params, (), model=model)


REFUSALS = {
    "axis": r"PlanError: ExpertParallel\(axis='ep'\) names an axis the mesh does not have: mesh "
    r"axes are \('fsdp',\)",
    "dense": r"PlanError: expert_parallel\(axis='ep'\): the model has no routed experts .* "
    r"d9d\.shard_params\(mesh, replicate_axis='ep'\)",
    "indivisible": r"PlanError: expert_parallel\(axis='ep'\): 'layers\.1\.mlp\.experts\.w_(gate|up|"
    r"down)' holds 5 experts, which do not split over the 2 ranks of 'ep'; use an expert count "
    r"divisible by 2",
    "no model": r"PlanError: expert_parallel\(axis='ep'\) intercepts the model's experts modules "
    r"and needs the model",
    "experts on tp": r"PlanError: param 'layers\.1\.mlp\.experts\.w_\w+' is sharded over 'tp' .* "
    r"\(Experts\) is not one tensor_parallel knows .* Routed experts stay whole on 'tp': map "
    r"neither 'experts' nor 'expert_mlp' to 'tp' in tensor_parallel's rules",
}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", list(REFUSALS))
def test_refusals_name_the_param_or_axis_and_the_fix(kind: str) -> None:
    with pytest.raises(RankFailedError, match=REFUSALS[kind]):
        run_on_ranks(_refused_rank, 2, kind, timeout=120)


def _microbatched_rank():
    mesh = d9d.make_mesh("cpu", fsdp=2, ep=2)
    model, opt = _model(8), optimizer()
    step = d9d.expert_parallel(mesh)(make_train_step(model, opt))
    step = d9d.shard_params(mesh, axis="fsdp", microbatches=2)(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    return trained(step, params, state)


@pytest.mark.distributed
def test_microbatched_expert_parallel_equals_one_device_accumulating() -> None:
    """``ep=2 x fsdp=2`` with 2 microbatches: the expert grads, left unreduced and scaled per
    microbatch, add up to the accumulation written out on one device."""
    want_metrics, want_params = accumulated_reference(lambda: _model(8), 2, 4)
    for metrics, params in run_on_ranks(_microbatched_rank, 4, timeout=300):
        torch.testing.assert_close(metrics, want_metrics, **TOL)
        assert_trees_all_close(params, want_params, **PARAM_TOL)


def _pipelined_rank(microbatches: int):
    mesh = d9d.make_mesh("cpu", pp=2, ep=2)
    model, opt = _model(8), optimizer()
    step = d9d.expert_parallel(mesh)(make_train_step(model, opt))
    step = d9d.pipeline(mesh, "pp", schedule="1f1b", microbatches=microbatches)(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    return trained(step, params, state)


@pytest.mark.distributed
def test_pipelined_expert_parallel_with_microbatches_equals_one_device_accumulating() -> None:
    """``pp=2 x ep=2``, 1F1B over 2 microbatches (stage 1 holds the MoE block, its experts on
    ``ep``): each microbatch's dispatch and combine run among the stage's ep ranks, and the
    step equals the accumulation written out on one device (microbatch ``m``: the ``m``-th
    half of each ep rank's rows)."""
    want_metrics, want_params = accumulated_reference(lambda: _model(8), 2, 2)
    ranks = run_on_ranks(_pipelined_rank, 4, 2, method="fork", timeout=300)
    for metrics, params in ranks:
        torch.testing.assert_close(metrics, want_metrics, **TOL)
        assert_trees_all_close(params, {k: want_params[k] for k in params}, **PARAM_TOL)
    assert set().union(*(params for _, params in ranks)) == set(want_params)


def _remat_rank(policy: str):
    mesh = d9d.make_mesh("cpu", ep=2)
    model, opt = _model(8), optimizer()
    step = d9d.remat(policy, mesh=mesh)(d9d.expert_parallel(mesh)(make_train_step(model, opt)))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    count = step.comms(params, state, step.shard_batch(batches()[0])).count[("all_to_all", "ep")]
    return count, *trained(step, params, state)


@pytest.mark.distributed
@pytest.mark.parametrize(("policy", "recomputed"), [("selective", 0), ("full", 5)])
def test_selective_remat_keeps_the_dispatch_full_remat_runs_it_again(
    policy: str, recomputed: int
) -> None:
    """ep=2, one MoE block: a step without remat runs 8 all-to-alls on 'ep' (forward: the
    counts, the tokens, their ids, their weights, the rows back; backward: the rows' grads
    out, the tokens' and weights' grads back). ``remat("selective")`` keeps the forward's
    outputs (no all-to-all again in the backward); ``remat("full")`` recomputes the block,
    its 5 forward all-to-alls included. Both equal one device."""
    want_metrics, want_params = _reference(8, False)
    for count, metrics, params in run_on_ranks(_remat_rank, 2, policy, timeout=300):
        assert count == 8 + recomputed
        torch.testing.assert_close(metrics, want_metrics, **TOL)
        assert_trees_all_close(params, want_params, **PARAM_TOL)
