"""The dtype microbatch grads are summed in, for every stored x compute x reduce dtype, under
``shard_params(microbatches=2)`` and under ``pipeline``: one rule (docs/sharding.md), the
widest of the three, against a one-device reference that does its casts by hand.

The reference computes each slice's grads in the compute dtype, widens them to the rule's
dtype and sums each rank's microbatches there, rounds each sum to the reduce dtype and sums
over ranks there, then rounds to the stored dtype; every scale is a power of two (exact).
"""

from __future__ import annotations

import copy
import functools
import itertools
from typing import Any

import pytest
import torch
from equivalence import batches, llama

import d9d
from d9d.testing import run_on_ranks

pytestmark = pytest.mark.distributed

BF16, F32 = torch.bfloat16, torch.float32
COMBINATIONS = list(itertools.product([F32, BF16], [None, BF16, F32], [None, BF16, F32]))
_BATCH = batches(256, global_batch=4, seq_len=8, steps=1)[0]


def _widest(*dtypes: torch.dtype) -> torch.dtype:
    return max(dtypes, key=lambda d: d.itemsize)


def _loss(model: d9d.Model, params: dict, batch: dict) -> torch.Tensor:
    return d9d.losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])


def _slice_grads(model: d9d.Model, compute: torch.dtype, rows: int = 4) -> list[list[torch.Tensor]]:
    """The grads of each of the batch's first ``rows`` rows (a microbatch each), computed
    in ``compute``."""
    out = []
    for row in range(rows):
        part = {k: v[row : row + 1] for k, v in _BATCH.items()}
        params = {k: v.detach().to(compute).requires_grad_() for k, v in model.params.items()}
        out.append(list(torch.autograd.grad(_loss(model, params, part), list(params.values()))))
    return out


def _reference(
    each: list[list[torch.Tensor]], stored: torch.dtype, wide: torch.dtype, reduce: torch.dtype
) -> list[torch.Tensor]:
    """Each rank's 2 microbatches of ``each`` summed in ``wide``, the sums rounded to
    ``reduce`` and summed over the 2 ranks there, the mean rounded to ``stored``."""
    ranks = [
        [(a.to(wide) + b.to(wide)).to(reduce) for a, b in zip(x, y, strict=True)]
        for x, y in zip(each[::2], each[1::2], strict=True)
    ]
    return [((a + b) / len(each)).to(stored) for a, b in zip(*ranks, strict=True)]


def _sharded(models: dict[torch.dtype, d9d.Model]) -> list[tuple[dict, dict | None, Any]]:
    """Per combination: the grads the step body gets on fsdp=2 with 2 microbatches (whole),
    the bytes it moves (for one) and what ``step.memory`` counts."""
    mesh = d9d.make_mesh("cpu", fsdp=2)
    out = []
    for stored, compute, reduce in COMBINATIONS:
        model = copy.deepcopy(models[stored])

        def grads_step(params: dict, opt_state: tuple, batch: dict, model=model) -> tuple:
            grads = d9d.value_and_grad(lambda p, b: _loss(model, p, b))(params, batch)[1]
            return grads, opt_state, {}

        options = {"param_dtype": compute, "reduce_dtype": reduce, "microbatches": 2}
        step = d9d.shard_params(mesh, "fsdp", **options)(grads_step)
        params, _ = step.place(model.params, (), model=model)
        batch = step.shard_batch(_BATCH)
        # Counted for the one combination whose bytes the rule changed (the grads tell the
        # reduce dtype of every other): step.comms runs the step again.
        checked = (stored, compute, reduce) == (F32, None, BF16)
        comms = step.comms(params, (), batch).bytes if checked else None
        grads, _, _ = step(params, (), batch)
        whole = {k: g.full_tensor() for k, g in grads.items()}
        out.append((whole, comms, step.memory(params, ())))
    return out


def test_shard_params_sums_microbatch_grads_in_the_widest_dtype_and_reduces_in_reduce_dtype() -> (
    None
):
    """fsdp=2, 2 microbatches, each of the 18 combinations: the grads equal the reference bit
    for bit, the reduce-scatter moves the reduce dtype and ``accumulated_grads`` counts the
    widest dtype. float32 params under a bf16 ``reduce_dtype`` rounded each microbatch's grad
    to bf16, summed in float32 and reduce-scattered float32 (twice the bytes, and
    ``step.memory`` counted bf16 sums); bf16 params computed in float32 summed in bf16."""
    small = {"dim": 32, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 48}
    models = {F32: llama(F32, 1, **small)(), BF16: llama(BF16, 1, **small)()}
    got = run_on_ranks(_sharded, 2, models)[0]
    each = {(s, c): _slice_grads(models[s], c) for s in (F32, BF16) for c in (F32, BF16)}
    for (stored, compute, reduce), (grads, comms, memory) in zip(COMBINATIONS, got, strict=True):
        case, params = (stored, compute, reduce), models[stored].params
        compute, reduce = compute or stored, reduce or stored
        wide = _widest(stored, compute, reduce)
        wanted = _reference(each[stored, compute], stored, wide, reduce)
        for (key, grad), want in zip(grads.items(), wanted, strict=True):
            assert torch.equal(grad, want), (case, key)
        elements = sum(p.numel() for p in params.values())
        if comms is not None:
            assert comms[("reduce_scatter", "fsdp")] == elements * reduce.itemsize
        assert memory.accumulated_grads == elements * wide.itemsize, case


def _staged(models: dict[torch.dtype, d9d.Model]) -> list[tuple[dict, Any]]:
    """Per combination: the grads of this rank's stage on pp=2 (fsdp=1) under 1F1B with 4
    microbatches of a row each (whole), and what ``step.memory`` counts."""
    mesh = d9d.make_mesh("cpu", pp=2, fsdp=1)
    out = []
    for stored, compute, reduce in COMBINATIONS:
        model = copy.deepcopy(models[stored])

        def grads_step(params: dict, opt_state: tuple, batch: dict, model=model) -> tuple:
            grads = d9d.value_and_grad(lambda p, b: _loss(model, p, b))(params, batch)[1]
            return grads, opt_state, {}

        step = d9d.pipeline(mesh, microbatches=4)(grads_step)
        options = {"param_dtype": compute, "reduce_dtype": reduce}
        step = d9d.shard_params(mesh, "fsdp", **options)(step)
        params, _ = step.place(model.params, (), model=model)
        grads, _, _ = step(params, (), step.shard_batch(_BATCH))
        out.append(({k: g.full_tensor() for k, g in grads.items()}, step.memory(params, ())))
    return out


def test_pipeline_stages_sum_microbatch_grads_in_the_widest_dtype() -> None:
    """pp=2 under 1F1B, 4 microbatches, each of the 18 combinations: each stage's grads equal
    the reference (one rank: the 4 microbatches summed in order) bit for bit, and its
    ``accumulated_grads`` counts the widest dtype. A stage summed float32 params' bf16 grads
    in bf16 under a bf16 ``reduce_dtype`` (``.grad``'s sums), where
    ``shard_params(microbatches=k)`` sums them in float32."""
    small = {"dim": 32, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 48}
    models = {F32: llama(F32, 2, **small)(), BF16: llama(BF16, 2, **small)()}
    ranks = run_on_ranks(_staged, 2, models, method="fork", timeout=300)
    each = {(s, c): _slice_grads(models[s], c) for s in (F32, BF16) for c in (F32, BF16)}
    for i, (stored, compute, reduce) in enumerate(COMBINATIONS):
        case, params = (stored, compute, reduce), models[stored].params
        compute, reduce = compute or stored, reduce or stored
        wide = _widest(stored, compute, reduce)
        rows = each[stored, compute]
        summed = [
            functools.reduce(torch.add, [g.to(wide) for g in gs]) for gs in zip(*rows, strict=True)
        ]
        wanted = {k: (g.to(reduce) / 4).to(stored) for k, g in zip(params, summed, strict=True)}
        for grads, memory in (ranks[0][i], ranks[1][i]):
            for key, grad in grads.items():
                assert torch.equal(grad, wanted[key]), (case, key)
            elements = sum(params[k].numel() for k in grads)
            assert memory.accumulated_grads == elements * wide.itemsize, case
