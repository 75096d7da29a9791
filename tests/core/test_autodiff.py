from __future__ import annotations

import pytest
import torch

import d9d
from d9d.core._autodiff import stack_aux


def test_value_and_grad_matches_autograd_and_keeps_paths() -> None:
    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    x = torch.randn(5, 3)

    def loss(p, x):
        return (x @ p["w"] + p["b"]).tanh().square().mean()

    value, grads = d9d.value_and_grad(loss)(params, x)
    w = params["w"].clone().requires_grad_()
    b = params["b"].clone().requires_grad_()
    expected = loss({"w": w, "b": b}, x)
    expected.backward()
    torch.testing.assert_close(value, expected.detach())
    assert list(grads) == ["w", "b"]
    torch.testing.assert_close(grads["w"], w.grad)
    torch.testing.assert_close(grads["b"], b.grad)
    assert not value.requires_grad and not grads["w"].requires_grad


def test_has_aux_returns_detached_aux_and_unused_leaves_get_zeros() -> None:
    params = {"used": torch.ones(2), "unused": torch.ones(3)}

    def loss(p):
        y = p["used"] * 2
        return y.sum(), {"y": y}

    (value, aux), grads = d9d.value_and_grad(loss, has_aux=True)(params)
    assert value.item() == 4.0 and not aux["y"].requires_grad
    torch.testing.assert_close(grads["unused"], torch.zeros(3))
    g, aux2 = d9d.grad(loss, has_aux=True)(params)
    torch.testing.assert_close(g["used"], torch.full((2,), 2.0))
    torch.testing.assert_close(aux2["y"], aux["y"])


def test_params_are_not_modified_and_caller_grad_mode_is_kept() -> None:
    params = {"w": torch.ones(2)}
    with torch.no_grad():
        d9d.grad(lambda p: (p["w"] ** 2).sum())(params)
    assert not params["w"].requires_grad and params["w"].grad is None


def test_integer_leaf_is_rejected_with_its_path() -> None:
    with pytest.raises(TypeError, match=r"params leaf 'step' of dtype torch.int64"):
        d9d.grad(lambda p: p["w"].sum())({"w": torch.ones(2), "step": torch.tensor(1)})


def test_non_scalar_value_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"must return a 0-d float tensor, got \(2,\)"):
        d9d.grad(lambda p: p["w"] * 2)({"w": torch.ones(2)})


def test_a_value_cut_off_from_the_params_is_named() -> None:
    """Not autograd's "element 0 of tensors does not require grad": what went wrong and what
    to do."""
    params = {"w": torch.randn(3)}
    for cut_off in (lambda p: p["w"].detach().sum(), lambda p: torch.tensor(p["w"].sum().item())):
        with pytest.raises(ValueError, match="does not depend on the params through autograd"):
            d9d.value_and_grad(cut_off)(params)


@pytest.mark.compile  # backend "aot_eager": Dynamo and AOTAutograd tracing only (~2 s)
def test_value_and_grad_of_plain_and_dtensor_params_traces_as_one_graph(one_rank_mesh) -> None:
    """Marking params for differentiation and ``autograd.grad`` are graph nodes Dynamo does
    not look into: torch 2.11's Dynamo graph-breaks on ``requires_grad_`` and its
    ``autograd.grad`` asserts on DTensor inputs."""
    from torch.distributed.tensor import Shard, distribute_tensor

    x = torch.randn(5, 3)
    params = {"w": distribute_tensor(torch.randn(3, 4), one_rank_mesh, [Shard(0)])}
    params["b"] = torch.randn(4)

    def loss(p, x):
        return (x @ p["w"].full_tensor() + p["b"]).tanh().square().mean()

    def step(p, x):
        return d9d.value_and_grad(loss)(p, x)

    expected_value, expected = step(params, x)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            value, grads = torch.compile(step, backend="aot_eager", fullgraph=True)(params, x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(value, expected_value)
    torch.testing.assert_close(grads["w"].full_tensor(), expected["w"].full_tensor())
    torch.testing.assert_close(grads["b"], expected["b"])


def test_stacked_aux_weighs_scalars_by_token_counts_and_concatenates_the_rest() -> None:
    auxes = [
        {"ce": torch.tensor(1.0), "load": torch.ones(2)},
        {"ce": torch.tensor(4.0), "load": torch.zeros(2)},
    ]
    weighted = stack_aux(auxes, [torch.tensor(3.0), torch.tensor(1.0)])
    assert weighted["ce"].item() == 1.75  # (3 * 1 + 1 * 4) / 4
    assert weighted["load"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert stack_aux(auxes)["ce"].item() == 2.5  # no counts: every microbatch alike
    assert stack_aux(auxes, [None, None])["ce"].item() == 2.5


def test_stacked_aux_averages_integer_and_boolean_scalars_in_float64() -> None:
    """A token count returned as aux: its weighted mean in int64 truncated to 0 (a bool to 2),
    and its plain mean raised inside torch."""
    auxes = [
        {"n": torch.tensor(2), "any": torch.tensor(True)},
        {"n": torch.tensor(1), "any": torch.tensor(False)},
    ]
    weighted = stack_aux(auxes, [torch.tensor(2.0), torch.tensor(1.0)])
    assert weighted["n"].dtype == torch.float64
    torch.testing.assert_close(weighted["n"], torch.tensor(5 / 3, dtype=torch.float64))
    torch.testing.assert_close(weighted["any"], torch.tensor(2 / 3, dtype=torch.float64))
    assert stack_aux(auxes)["n"].item() == 1.5


def test_stacked_aux_refuses_a_python_number_by_path() -> None:
    auxes = [{"m": {"lr": 0.1}, "ce": torch.tensor(1.0)}] * 2
    with pytest.raises(TypeError, match=r"aux leaf 'm\.lr' is a float, not a tensor"):
        stack_aux(auxes)
