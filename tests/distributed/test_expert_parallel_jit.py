"""``d9d.jit`` of ``expert_parallel`` steps: one graph for 5 steps whose routing differs (a
rank receiving no token in two of them), equal to the eager step bit for bit and to one
device, with the eager step's all-to-alls; and under ``shard_params`` over ``fsdp`` (expert
FSDP), as ``d9d train --ep`` composes them. The split sizes the dispatch reads on the host
are unbacked sizes of the graph (``docs/decisions.md``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from moe_steps import METRICS, PARAM_TOL, TOL, batches, optimizer
from torch.distributed.tensor import distribute_tensor

import d9d
from d9d.core._comm_count import CollectiveCounter
from d9d.models import MoE, MoEConfig
from d9d.models.moe import make_train_step
from d9d.testing import assert_trees_all_close, run_on_ranks

BIAS = "layers.0.mlp.router.expert_bias"
EXPERTS = 8
# The router bias set before each step (over the step's own update of it): +10 on two
# experts routes every token to those two. Steps 1 and 3 send every token to rank 0's
# experts (0-3), then to rank 1's (4-7): the other rank receives nothing and six experts
# are empty; step 4 sends every token to both ranks; steps 0 and 2 route as trained.
SKEW = {1: (0, 1), 3: (6, 7), 4: (2, 5)}


def _model() -> d9d.Model:
    """One MoE block of 8 experts (a third of the decoder's compile time), float64."""
    config = MoEConfig.tiny()
    config = replace(
        config, n_layers=1, n_dense_layers=0, moe=replace(config.moe, n_experts=EXPERTS)
    )
    return d9d.functionalize(MoE(config).to(torch.float64))


def _bias(i: int) -> torch.Tensor:
    bias = torch.zeros(EXPERTS, dtype=torch.float64)
    bias[list(SKEW.get(i, ()))] = 10.0
    return bias


@torch.no_grad()
def _set_bias(params: dict, i: int) -> None:
    """Step ``i``'s bias written into the placed bias' own buffer (donated under jit)."""
    placed = params[BIAS]
    local = distribute_tensor(_bias(i), placed.device_mesh, placed.placements, src_data_rank=None)
    placed.to_local().copy_(local.to_local())


def _reference() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model, opt = _model(), optimizer()
    step = make_train_step(model, opt)
    params = {k: v.clone() for k, v in model.params.items()}
    state, metrics = opt.init(params), []
    for i, batch in enumerate(batches()):
        params[BIAS] = _bias(i)
        params, state, m = step(params, state, batch)
        metrics.append(torch.stack([m[k] for k in METRICS]))
    return torch.stack(metrics), params


def _rank(mesh_axes: dict[str, int], jit_only: bool):
    """Per run (eager, then jitted; or jitted only): metrics, whole params, traces, and
    each step's all-to-all bytes on ``ep`` (eager: ``step.comms``; jitted: counted as the
    compiled graph runs, from its second call)."""
    runs = []
    for jit in (True,) if jit_only else (False, True):
        mesh = d9d.make_mesh("cpu", **mesh_axes)
        model, opt = _model(), optimizer()
        step = d9d.expert_parallel(mesh)(make_train_step(model, opt))
        if "fsdp" in mesh_axes:
            step = d9d.shard_params(mesh, axis="fsdp")(step)
        if jit:
            step = d9d.jit(step, backend="aot_eager")
        params, state = step.place(model.params, opt.init(model.params), model=model)
        metrics, moved = [], []
        for i, batch in enumerate(batches()):
            batch = step.shard_batch(batch)
            _set_bias(params, i)
            stats = None
            if not jit:
                stats = step.comms(params, state, batch)
                params, state, m = step(params, state, batch)
            elif i:  # the first call compiles
                with CollectiveCounter(mesh) as counter:
                    params, state, m = step(params, state, batch)
                stats = counter.stats
            else:
                params, state, m = step(params, state, batch)
            metrics.append(torch.stack([m[k] for k in METRICS]))
            if stats is not None:
                moved.append((stats.count[("all_to_all", "ep")], stats.bytes[("all_to_all", "ep")]))
        whole = {k: v.full_tensor() for k, v in params.items()}
        runs.append((torch.stack(metrics), whole, getattr(step, "traces", 0), moved))
    return runs


def _skewed_bytes(rank: int, experts: tuple[int, ...]) -> int:
    """One step's all-to-all bytes on ``ep`` of ``rank`` (of 2) when every token routes to
    ``experts``: the counts; forward, the tokens that leave the rank with their ids (int32)
    and weights, the rows back of the tokens received; backward, the rows' grads out and
    the tokens' and weights' grads back (``test_expert_parallel.py`` derives the same)."""
    tokens, config = 4 * 16, MoEConfig.tiny().moe  # 4 of the 8 rows of 16 per rank
    row, k, local = config.dim * 8, config.top_k, EXPERTS // 2
    owners = {e // local for e in experts}
    sent = tokens if 1 - rank in owners else 0
    received = tokens if rank in owners else 0
    counts = 2 * (local + 1) * 8
    return counts + 2 * (sent + received) * row + sent * k * 4 + (sent + received) * k * 8


@pytest.mark.compile
def test_jit_one_graph_over_routing_that_differs_equals_eager_bit_for_bit() -> None:
    """ep=2: one trace for the 5 steps, whose routing differs (a rank receives nothing in
    steps 1 and 3); metrics and params equal to the eager step bit for bit (aot_eager runs
    the eager kernels) and to one device; the all-to-alls of steps 2 to 5 equal the eager
    step's ``step.comms`` in count and bytes, those of the skewed steps as derived."""
    want_metrics, want_params = _reference()
    ranks = run_on_ranks(_rank, 2, {"ep": 2}, False, timeout=600)
    for rank, (eager, jitted) in enumerate(ranks):
        assert jitted[2] == 1  # one graph for all steps: no graph break, no recompile
        assert torch.equal(jitted[0], eager[0]), (jitted[0], eager[0])
        for path, value in eager[1].items():
            assert torch.equal(jitted[1][path], value), path
        assert jitted[3] == eager[3][1:]
        assert len({moved for _, moved in eager[3]}) == len(eager[3])  # bytes differ per step
        assert all(count == 8 for count, _ in eager[3])
        for i, experts in SKEW.items():
            assert eager[3][i][1] == _skewed_bytes(rank, experts), (rank, i)
        torch.testing.assert_close(jitted[0], want_metrics, **TOL)
        assert_trees_all_close(jitted[1], want_params, **PARAM_TOL)


@pytest.mark.compile
def test_jit_with_expert_fsdp_equals_one_device() -> None:
    """ep=2 x fsdp=2 (dense params FSDP over fsdp, experts over ep and fsdp): one trace for
    the 5 steps of differing routing, equal to one device."""
    want_metrics, want_params = _reference()
    for ((metrics, params, traces, _),) in run_on_ranks(
        _rank, 4, {"ep": 2, "fsdp": 2}, True, timeout=600
    ):
        assert traces == 1
        torch.testing.assert_close(metrics, want_metrics, **TOL)
        assert_trees_all_close(params, want_params, **PARAM_TOL)
