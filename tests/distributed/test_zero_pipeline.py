"""ZeRO-1 and ZeRO-2 (``shard_params(shard="opt_state" | "grads")``) inside ``pipeline``
stages: against one device fed the whole batch, bit for bit against ZeRO-3 under the same
pipeline, and their communication and memory per rank, exactly.

Ranks are forked gloo processes: the threaded group has no point-to-point ops.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from equivalence import batches, llama, optimizer, reference, train_step

import d9d
from d9d.testing import run_on_ranks
from d9d.transforms.pipeline import PipelineRuntime

pytestmark = pytest.mark.distributed

ZERO = {"zero1": "opt_state", "zero2": "grads"}

SCHEDULES = {
    "1f1b": {"schedule": "1f1b", "microbatches": 2},
    "zbv": {"schedule": "zbv", "microbatches": 4, "virtual_stages": 2},
}

N_LAYERS = 4


@functools.cache
def _reference(tie: bool = False):
    return reference(llama(torch.float64, N_LAYERS, tie_embeddings=tie), batches(256))


def _train_rank(schedule: str, shards: tuple[str, ...], tie: bool = False):
    """5 AdamW steps with clipping, float64, on pp=2 x fsdp=2, once per ``shard`` (from the
    same initial params): each run's losses and the params of this rank's stages, whole."""
    runs = {}
    for shard in shards:
        mesh = d9d.make_mesh("cpu", pp=2, fsdp=2)
        model, opt = llama(torch.float64, N_LAYERS, tie_embeddings=tie)(), optimizer()
        step = d9d.pipeline(mesh, **SCHEDULES[schedule])(train_step(model, opt))
        step = d9d.shard_params(mesh, "fsdp", shard=shard)(step)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        losses = []
        for batch in batches(256):
            params, state, metrics = step(params, state, step.shard_batch(batch))
            losses.append(metrics["loss"])
        runs[shard] = torch.stack(losses), {k: v.full_tensor() for k, v in params.items()}
    return runs


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("zero", list(ZERO))
def test_equals_one_device_and_zero3_bit_for_bit(zero: str, schedule: str) -> None:
    """pp=2 x fsdp=2, float64, 5 AdamW steps after global-norm clipping: losses and every
    param equal one device fed the whole batch (rel 1e-9), and ZeRO-3 under the same
    pipeline bit for bit (the same reduce-scatter or, for ZeRO-1, an all-reduce of two
    addends, the same update on the same shard)."""
    ref_losses, ref_params = _reference()
    ranks = run_on_ranks(
        _train_rank, 4, schedule, (ZERO[zero], "params"), method="fork", timeout=600
    )
    seen = set()
    for runs in ranks:
        losses, params = runs[ZERO[zero]]
        zero3_losses, zero3_params = runs["params"]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-9, atol=1e-12)
        for path, value in params.items():
            torch.testing.assert_close(value, ref_params[path], rtol=1e-9, atol=1e-12)
            assert torch.equal(value, zero3_params[path]), path
        assert torch.equal(losses, zero3_losses)
        seen |= set(params)
    assert seen == set(ref_params)


def test_tied_embedding_slices_sum_over_the_end_stages() -> None:
    """A head tied to the embedding, held by stage 0 (rank 0) and stage 1 (rank 1) under
    1F1B: each end stage reduces its grad to its fsdp slice, and the two slices are summed
    over the pair of ranks holding the same slice; ZeRO-2, equal to one device."""
    ref_losses, ref_params = _reference(tie=True)
    for runs in run_on_ranks(_train_rank, 4, "1f1b", ("grads",), True, method="fork"):
        losses, params = runs["grads"]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-9, atol=1e-12)
        assert "embed.weight" in params
        for path, value in params.items():
            torch.testing.assert_close(value, ref_params[path], rtol=1e-9, atol=1e-12)


def _counted_rank(shard: str):
    """One float32 step's collectives (``step.comms``) and this rank's memory
    (``step.memory``) on pp=2 x fsdp=2 under 1F1B, 2 microbatches, and its stage's params."""
    mesh = d9d.make_mesh("cpu", pp=2, fsdp=2)
    model, opt = llama(torch.float32, N_LAYERS)(), optimizer()
    step = d9d.pipeline(mesh, microbatches=2)(train_step(model, opt))
    step = d9d.shard_params(mesh, "fsdp", shard=shard)(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    stats = step.comms(params, state, step.shard_batch(batches(256)[0]))
    layout = next(r for r in step.runtimes if isinstance(r, PipelineRuntime)).layout
    shapes = {k: tuple(model.params[k].shape) for k in layout.held}
    local = {k: tuple(v.to_local().shape) for k, v in params.items()}
    counters = sum(x.numel() * x.element_size() for x in d9d.tree.leaves(state) if x.ndim == 0)
    return (
        shapes,
        local,
        dict(stats.count),
        dict(stats.bytes),
        step.memory(params, state),
        counters,
        step.plan.table(),
    )


def test_communication_and_memory_per_rank_are_exact() -> None:
    """Tiny Llama of 4 blocks in float32 (every dim 0 even), two stages: per step over
    fsdp, ZeRO-2 reduce-scatters its stage's grads once (Ψ_stage · 4 bytes in) and ZeRO-1
    all-reduces them once, and both all-gather the updated params once (Ψ_stage · 4
    bytes out), nothing else but ZeRO-3's scalars (the token count, the clipping norm);
    params stay whole on each rank, the grads the update sees are 1/fsdp (ZeRO-1 slices its
    all-reduced ones), AdamW's moments 1/fsdp. ZeRO-3 under the same pipeline gathers its stage once and
    reduce-scatters it once."""
    results = {
        s: run_on_ranks(_counted_rank, 4, s, method="fork") for s in (*ZERO.values(), "params")
    }
    for shard, ranks in results.items():
        for (shapes, local, count, nbytes, memory, counters, table), zero3 in zip(
            ranks, results["params"], strict=True
        ):
            psi = sum(math.prod(s) for s in shapes.values())
            whole, half = 4 * psi, 4 * psi // 2
            halves = {k: (s[0] // 2, *s[1:]) for k, s in shapes.items()}
            fsdp = {k: v for k, v in count.items() if k[1] == "fsdp"}
            scalars = {k: v for k, v in zero3[2].items() if k == ("all_reduce", "fsdp")}
            if shard == "params":
                assert local == halves
                assert fsdp == {("all_gather", "fsdp"): 1, ("reduce_scatter", "fsdp"): 1, **scalars}
                assert nbytes[("all_gather", "fsdp")] == nbytes[("reduce_scatter", "fsdp")] == whole
                assert (memory.params, memory.grads) == (half, half)
                continue
            assert local == shapes  # whole on every rank of the stage
            assert f"ZeRO-{1 if shard == 'opt_state' else 2}" in table
            assert nbytes[("all_gather", "fsdp")] == whole
            if shard == "grads":
                assert fsdp == {("all_gather", "fsdp"): 1, ("reduce_scatter", "fsdp"): 1, **scalars}
                assert nbytes[("reduce_scatter", "fsdp")] == whole
                assert nbytes[("all_reduce", "fsdp")] == zero3[3][("all_reduce", "fsdp")]
                assert (memory.params, memory.grads) == (whole, half)
            else:
                reduced = scalars[("all_reduce", "fsdp")] + 1
                assert fsdp == {("all_gather", "fsdp"): 1, ("all_reduce", "fsdp"): reduced}
                extra = nbytes[("all_reduce", "fsdp")] - zero3[3][("all_reduce", "fsdp")]
                assert extra == whole
                assert (memory.params, memory.grads) == (whole, half)
            assert memory.opt_state == 2 * half + counters
            # pp moves what it moves under ZeRO-3: activations, their grads, the loss
            assert {k: v for k, v in count.items() if k[1] == "pp"} == {
                k: v for k, v in zero3[2].items() if k[1] == "pp"
            }
