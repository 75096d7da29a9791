"""The loss is the mean over the valid tokens of the global batch, in every layout.

SFT-like batches: each row's labels are ignored (-100) up to a prompt length that differs
wildly between rows, and two rows are ignored whole, so data-parallel ranks, cp ranks and
microbatches each hold a different number of valid tokens. Every layout must equal one device
fed the whole batch (float64, 5 AdamW steps with clipping): a mean of per-rank or
per-microbatch means does not.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from equivalence import assert_equivalent, batches, llama, reference

import d9d
from d9d.errors import RankFailedError
from d9d.testing import run_on_ranks

pytestmark = pytest.mark.distributed

F64 = torch.float64

# Prompt length per row of a global batch of 8 x 16: rows 0-3 (rank 0 of 2) keep 25 labels,
# rows 4-7 keep 47; rows 2 and 5 keep none.
PROMPTS = (3, 12, 16, 10, 0, 16, 5, 1)

LAYOUTS = {
    "fsdp=2": ({"fsdp": 2}, "thread", lambda m: [d9d.shard_params(m, "fsdp")]),
    "dp=2 x fsdp=2": (
        {"dp": 2, "fsdp": 2},
        "thread",
        lambda m: [d9d.shard_params(m, "fsdp", "dp")],
    ),
    "fsdp=2, 2 microbatches": (
        {"fsdp": 2},
        "thread",
        lambda m: [d9d.shard_params(m, "fsdp", microbatches=2)],
    ),
    "fsdp=1, 4 microbatches": (
        {"fsdp": 1},
        "thread",
        lambda m: [d9d.shard_params(m, "fsdp", microbatches=4)],
    ),
    "fsdp=2 x cp=2": (
        {"fsdp": 2, "cp": 2},
        "thread",
        lambda m: [d9d.context_parallel(m), d9d.shard_params(m, "fsdp")],
    ),
    "fsdp=2 x cp=2, 2 microbatches": (
        {"fsdp": 2, "cp": 2},
        "thread",
        lambda m: [d9d.context_parallel(m), d9d.shard_params(m, "fsdp", microbatches=2)],
    ),
    "fsdp=2 x tp=2": (
        {"fsdp": 2, "tp": 2},
        "thread",
        lambda m: [d9d.tensor_parallel(m), d9d.shard_params(m, "fsdp")],
    ),
    "pp=2 1f1b, 4 microbatches": (
        {"pp": 2},
        "fork",
        lambda m: [d9d.pipeline(m, schedule="1f1b", microbatches=4)],
    ),
    "pp=2 x cp=2, 2 microbatches": (
        {"pp": 2, "cp": 2},
        "fork",
        lambda m: [d9d.context_parallel(m), d9d.pipeline(m, microbatches=2)],
    ),
    "pp=2 x dp=2, 2 microbatches": (
        {"pp": 2, "dp": 2},
        "fork",
        lambda m: [d9d.pipeline(m, microbatches=2), d9d.shard_params(m, None, "dp")],
    ),
}


def sft_batches() -> list[dict]:
    data = batches(256)
    for batch in data:
        labels = batch["labels"].clone()  # a view of the tokens
        for row, prompt in enumerate(PROMPTS):
            labels[row, :prompt] = -100
        batch["labels"] = labels
    return data


@functools.cache
def _reference(n_layers: int):
    return reference(llama(F64, n_layers), sft_batches())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_unevenly_ignored_labels_give_the_global_token_mean(layout: str) -> None:
    mesh_axes, method, transforms = LAYOUTS[layout]
    n_layers = 4 if "pp" in mesh_axes else 2
    assert_equivalent(
        llama(F64, n_layers),
        transforms,
        mesh_axes,
        sft_batches(),
        _reference(n_layers),
        dtype=F64,
        method=method,
    )


@pytest.mark.compile
def test_jit_weighs_microbatches_by_their_tokens() -> None:
    """The count each microbatch records is traced into the one captured graph."""
    assert_equivalent(
        llama(F64, 1),
        LAYOUTS["fsdp=2, 2 microbatches"][2],
        {"fsdp": 2},
        sft_batches(),
        _reference(1),
        dtype=F64,
        jit="aot_eager",
    )


def test_a_loss_without_token_means_weighs_microbatches_alike() -> None:
    """A loss that counts no tokens (a plain mean) gives each microbatch weight 1/k."""

    def rank():
        mesh = d9d.make_mesh("cpu", fsdp=1)

        def step(params, opt_state, batch):
            loss, _ = d9d.value_and_grad(lambda p, x: (p["w"].to_local() * x).mean())(
                params, batch["x"]
            )
            return params, opt_state, {"loss": loss}

        step = d9d.shard_params(mesh, microbatches=2)(step)
        params, state = step.place({"w": torch.ones(3, dtype=F64)}, ())
        x = torch.tensor([[1.0, 1, 1], [5, 5, 5]], dtype=F64)
        return step(params, state, {"x": x})[2]["loss"]

    assert run_on_ranks(rank, 1) == [torch.tensor(3.0, dtype=F64)]


def test_a_loss_counting_tokens_in_some_microbatches_only_is_refused() -> None:
    def rank():
        mesh = d9d.make_mesh("cpu", fsdp=1)

        def loss_fn(params, x):
            values = params["w"].to_local() * x
            if x.sum() > 5:  # only the second microbatch counts its tokens
                return d9d.losses.token_mean(values, torch.ones_like(x, dtype=torch.bool))
            return values.mean()

        def step(params, opt_state, batch):
            loss, _ = d9d.value_and_grad(loss_fn)(params, batch["x"])
            return params, opt_state, {"loss": loss}

        step = d9d.shard_params(mesh, microbatches=2)(step)
        params, state = step.place({"w": torch.ones(3, dtype=F64)}, ())
        step(params, state, {"x": torch.tensor([[1.0, 1, 1], [5, 5, 5]], dtype=F64)})

    with pytest.raises(RankFailedError, match=r"counted its tokens .* in some microbatches"):
        run_on_ranks(rank, 1)


def test_an_integer_metric_is_averaged_in_float64() -> None:
    """A step returning its valid-token count: over ranks the mean of an int64 tensor raised
    inside DTensor's all-reduce; over microbatches the weighted mean truncated it to 0."""

    def rank():
        mesh = d9d.make_mesh("cpu", fsdp=2)

        def loss_fn(params, x):
            valid = x > 0
            loss = d9d.losses.token_mean(params["w"].full_tensor() * x, valid)
            return loss, {"tokens": valid.sum()}

        def step(params, opt_state, batch):
            (loss, aux), _ = d9d.value_and_grad(loss_fn, has_aux=True)(params, batch["x"])
            return params, opt_state, {"loss": loss, "tokens": aux["tokens"], "rows": batch["n"]}

        step = d9d.shard_params(mesh, microbatches=2)(step)
        params, state = step.place({"w": torch.ones(2, dtype=F64)}, ())
        x = torch.tensor([[1.0, 1], [1, 0], [1, 0], [0, 0]], dtype=F64)
        batch = step.shard_batch({"x": x, "n": torch.tensor([[2], [1], [1], [0]])})
        return step(params, state, batch)[2]

    # Microbatch 0 holds 2 + 1 valid tokens over the ranks, microbatch 1 1 + 0: weights 3 and 1,
    # so rank 0 averages its counts 2 and 1 to 7/4, rank 1 its 1 and 0 to 3/4; over ranks 5/4.
    # The per-row metric is averaged over ranks as before.
    for metrics in run_on_ranks(rank, 2):
        assert metrics["tokens"].dtype == F64
        torch.testing.assert_close(metrics["tokens"], torch.tensor(5 / 4, dtype=F64))
        assert metrics["rows"].tolist() == [[1.5], [0.5]]


def test_a_python_number_metric_is_averaged_where_ranks_hold_different_tokens() -> None:
    """``loss.item()`` as a metric stayed each rank's own value, returned silently: its share
    of the token mean, rescaled (a float64 tiny Llama, fsdp=2, ranks holding 8 and 64 valid
    labels: 1.22 and 9.86 for a loss of 5.54). It is averaged like the tensor metrics now, and
    a constant (an lr, a flag) keeps its value."""
    built = llama(F64)()  # once: thread ranks share the RNG

    def rank(layout: dict[str, int]):
        mesh = d9d.make_mesh("cpu", **layout)
        model = copy.deepcopy(built)

        def step(params, opt_state, batch):
            logits = model.apply(params, batch["tokens"])
            loss = d9d.losses.cross_entropy(logits, batch["labels"])
            numbers = {"loss": loss.item(), "lr": 3e-4, "skipped": False}
            return params, opt_state, {"loss": loss, "eval": numbers}

        axes = ("fsdp", None) if "fsdp" in layout else (None, "dp")
        step = d9d.shard_params(mesh, *axes)(step)
        params, state = step.place(model.params, (), model=model)
        return step(params, state, step.shard_batch(sft_batches()[0]))[2]

    (one,) = run_on_ranks(rank, 1, {"dp": 1})  # nothing is averaged: the numbers as given
    assert one["eval"] == {"loss": one["loss"].item(), "lr": 3e-4, "skipped": False}
    for metrics in run_on_ranks(rank, 2, {"fsdp": 2}):
        numbers = metrics["eval"]
        torch.testing.assert_close(numbers["loss"], one["loss"], rtol=1e-12, atol=0)
        assert numbers["lr"].dtype == torch.float64 and numbers["lr"].item() == 3e-4
        assert numbers["skipped"].item() == 0.0


@pytest.mark.parametrize(
    ("dtype", "n"), [(torch.float16, 70_000), (torch.bfloat16, 300)], ids=["float16", "bfloat16"]
)
def test_a_half_precision_token_mean_weighs_microbatches_in_float32(
    dtype: torch.dtype, n: int
) -> None:
    """A loss whose per-token values are float16 or bfloat16, over 2 microbatches: one of
    ``n`` valid tokens of 0.5, one of 3 of 1.0. The token mean was of the values' dtype, and
    each microbatch's weight (its count) with it: a float16 count of 70,000 is inf (loss and
    grad NaN), a bfloat16 one rounded (loss 0.5039 and grad 0.5033 for 0.50495)."""

    def rank():
        mesh = d9d.make_mesh("cpu", fsdp=1)

        def loss_fn(params, x):
            return d9d.losses.token_mean(params["w"].to_local().to(dtype) * x.to(dtype), x > 0)

        def step(params, opt_state, batch):
            loss, grads = d9d.value_and_grad(loss_fn)(params, batch["x"])
            return params, opt_state, {"loss": loss, "grad": grads["w"].full_tensor()}

        step = d9d.shard_params(mesh, microbatches=2)(step)
        params, state = step.place({"w": torch.ones(())}, ())
        x = torch.zeros(2, n)
        x[0], x[1, :3] = 0.5, 1.0
        return step(params, state, {"x": x})[2]

    (metrics,) = run_on_ranks(rank, 1)
    exact = torch.tensor((0.5 * n + 3) / (n + 3))
    torch.testing.assert_close(metrics["loss"], exact, rtol=1e-6, atol=0)
    torch.testing.assert_close(metrics["grad"], exact, rtol=1e-3, atol=0)  # half autograd
