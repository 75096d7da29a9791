from __future__ import annotations

import pytest
import torch

import d9d


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
