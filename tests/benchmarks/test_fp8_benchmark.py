"""benchmarks/fp8.py: the linear it times is the one ``d9d.fp8`` runs for a linear it chooses,
and its SQNR is the textbook one. Its rows are checked by the GPU suite's smoke run."""

from __future__ import annotations

import math

import pytest
import torch

import d9d


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("fp8")


def test_sqnr_db(bench):
    assert bench.sqnr_db(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])) == 20.0
    assert bench.sqnr_db(torch.tensor([1.0, -2.0]), torch.tensor([1.0, -2.0])) == math.inf


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_the_timed_linear_is_what_d9d_fp8_runs(bench, recipe):
    model = d9d.functionalize(torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False)))
    generator = torch.Generator().manual_seed(0)
    batch = {"x": torch.randn(40, 64, generator=generator)}
    batch["dy"] = torch.randn(40, 48, generator=generator)

    def loss_fn(params, batch):
        return (model.apply(params, batch["x"]) * batch["dy"]).sum()

    def step(params, opt_state, batch):
        loss, grads = d9d.value_and_grad(loss_fn)(params, batch)
        return params, opt_state, {"loss": loss, "grad": grads["0.weight"]}

    step = d9d.fp8(recipe=recipe)(step)
    params, opt_state = step.place(model.params, (), model=model)
    _, _, metrics = step(params, opt_state, batch)
    weight = model.params["0.weight"].detach().requires_grad_()
    loss = (bench._forward(recipe)(batch["x"], weight) * batch["dy"]).sum()
    (grad,) = torch.autograd.grad(loss, weight)
    assert torch.equal(metrics["loss"], loss)
    assert torch.equal(metrics["grad"].full_tensor(), grad)
