"""``pipeline`` under ``shard_params(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``:
a stage sums its microbatches' bf16 weight grads in float32, as ``shard_params(microbatches=k)``
and FSDP2 do, and reduces the float32 sums.

Ranks are forked gloo processes: the threaded group has no point-to-point ops.
"""

from __future__ import annotations

import pytest
import torch
from equivalence import batches, llama

import d9d
from d9d.testing import run_on_ranks

pytestmark = pytest.mark.distributed

_MIXED = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
_SCHEDULES = {
    "1f1b": {"schedule": "1f1b", "microbatches": 2},
    "zbv": {"schedule": "zbv", "microbatches": 2, "virtual_stages": 2},
}


def _grads(options: dict, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The grads of one step on pp=2 x fsdp=2 over ``tokens`` (whole, on this rank's stages)."""
    mesh = d9d.make_mesh("cpu", pp=2, fsdp=2)
    model = llama(torch.float32, 4)()

    def loss_fn(params, batch):
        return d9d.losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])

    def step(params, opt_state, batch):
        _, grads = d9d.value_and_grad(loss_fn)(params, batch)
        return params, opt_state, grads

    step = d9d.pipeline(mesh, **options)(step)
    step = d9d.shard_params(mesh, "fsdp", **_MIXED)(step)
    params, state = step.place(model.params, (), model=model)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    _, _, grads = step(params, state, step.shard_batch(batch))
    return {k: v.full_tensor() for k, v in grads.items()}


def _step_and_microbatches(schedule: str) -> tuple[dict, list[dict]]:
    """The grads of a step over 2 microbatches of a row each, and, per microbatch, of a
    step whose 2 microbatches are that row twice (doubling is exact in bf16 too). Both fsdp
    ranks get the same rows, so a reduction over them doubles each sum exactly, and every
    other factor is a power of two (16 tokens a row): the step's grads are the mean of the
    others bit for bit when each stage sums its microbatches' bf16 grads in float32."""
    rows = batches(256, global_batch=2, steps=1)[0]
    tokens = torch.cat([rows["tokens"], rows["labels"][:, -1:]], dim=1)
    options = _SCHEDULES[schedule]
    whole = _grads(options, torch.cat([tokens, tokens]))
    parts = [_grads(options, row.expand(4, -1)) for row in tokens]
    return whole, parts


@pytest.mark.parametrize("schedule", list(_SCHEDULES))
def test_stages_sum_bf16_microbatch_grads_in_float32(schedule: str) -> None:
    """pp=2 x fsdp=2, bf16 compute, float32 reduction, 2 microbatches under 1F1B and ZBV
    (whose weight pass adds its grads to ``.grad`` itself): the reduced grads equal the sum
    in float32 of each microbatch's bf16 grads (one step per microbatch), bit for bit. Summed
    in bf16, as before, they were not; the weight pass's grads left in ``.grad`` were lost."""
    for whole, parts in run_on_ranks(_step_and_microbatches, 4, schedule, method="fork"):
        for path, grad in whole.items():
            summed = (parts[0][path] + parts[1][path]) / 2
            assert grad.dtype == torch.float32
            assert grad.count_nonzero() > 0, path  # a lost grad is zeros in both
            assert torch.equal(grad, summed), path
