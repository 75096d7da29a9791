"""Params leaves beyond real floating tensors: complex ones, as torch.optim takes them, and
integer, bool or None leaves (refused by name, or empty subtrees)."""

from __future__ import annotations

import pytest
import torch

import d9d.optim as optim

SHAPES = {"a": (7,), "b": (3, 2), "c": ()}


def _run(ours, theirs_cls, dtype, steps=50, **theirs_kwargs):
    torch.manual_seed(0)
    params = {k: torch.randn(s, dtype=dtype) for k, s in SHAPES.items()}
    theirs = [p.clone().requires_grad_() for p in params.values()]
    optimizer = theirs_cls(theirs, **theirs_kwargs)
    state = ours.init(params)
    for _ in range(steps):
        grads = {k: torch.randn_like(p) for k, p in params.items()}
        updates, state = ours.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        for p, g in zip(theirs, grads.values(), strict=True):
            p.grad = g.clone()
        optimizer.step()
    return params, theirs


@pytest.mark.parametrize(
    ("ours", "theirs_cls", "kwargs"),
    [
        (optim.adam(1e-2, b2=0.99), torch.optim.Adam, {"lr": 1e-2, "betas": (0.9, 0.99)}),
        (
            optim.adamw(1e-2, weight_decay=0.1),
            torch.optim.AdamW,
            {"lr": 1e-2, "weight_decay": 0.1},
        ),
        (optim.sgd(1e-2, momentum=0.9), torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    ],
    ids=["adam", "adamw", "sgd"],
)
def test_complex_params_follow_torch_optim(ours, theirs_cls, kwargs):
    """Adam's second moment took the complex square g*g (re**2 - im**2 + 2i re im), where
    torch.optim.Adam averages re**2 and im**2 apart: params were 0.2 off after 50 steps."""
    params, theirs = _run(ours, theirs_cls, torch.complex64, **kwargs)
    for p, t in zip(params.values(), theirs, strict=True):
        assert p.dtype == torch.complex64
        torch.testing.assert_close(p, t.detach(), rtol=1e-5, atol=1e-5)


def test_global_norm_of_complex_leaves_is_clip_grad_norm_s():
    """_foreach_norm with a float32 dtype raised on a complex leaf ("dtype should be complex
    for complex inputs"), so clip_by_global_norm failed on complex grads."""
    torch.manual_seed(0)
    grads = {"z": torch.randn(5, 3, dtype=torch.complex64), "x": torch.randn(4)}
    clip = optim.clip_by_global_norm(1.0)
    clipped, _ = clip.update(grads, clip.init(grads))
    theirs = [torch.zeros_like(g, requires_grad=True) for g in grads.values()]
    for p, g in zip(theirs, grads.values(), strict=True):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    torch.testing.assert_close(optim.global_norm(grads), norm)
    for ours, t in zip(clipped.values(), theirs, strict=True):
        torch.testing.assert_close(ours, t.grad, rtol=1e-6, atol=1e-6)
    assert optim.global_norm({"z": torch.ones(2, dtype=torch.complex128)}).dtype == torch.float64


def test_complex_params_refused_where_undefined():
    params = {"z": torch.zeros(3, dtype=torch.complex64)}
    with pytest.raises(
        TypeError,
        match=r"scale_by_lion takes params of floating tensors, got leaf 'z' of dtype torch.complex64",
    ):
        optim.lion(1e-3).init(params)
    with pytest.raises(
        ValueError, match=r"complex params \['z'\]: a real storage dtype would drop"
    ):
        optim.adamw(1e-3, mu_dtype=torch.bfloat16).init(params)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_and_bool_leaves_are_refused_by_name(dtype):
    """An integer leaf failed inside Adam's lerp with torch's own message, and SGD's float
    update was truncated back by apply_updates: an int64 3 became 2 after one step."""
    params = {"w": torch.ones(3), "n": torch.ones((), dtype=dtype)}
    match = rf"takes params of floating or complex tensors, got leaf 'n' of dtype {dtype}"
    for opt in (optim.adamw(1e-2), optim.sgd(1e-2), optim.sgd(1e-2, momentum=0.9)):
        with pytest.raises(TypeError, match=match):
            opt.init(params)
    with pytest.raises(TypeError, match=r"apply_updates " + match):
        optim.apply_updates(params, {"w": torch.ones(3), "n": torch.full((), -0.03)})


def test_none_leaves_are_empty_subtrees():
    params = {"w": torch.ones(3), "frozen": None}
    opt = optim.adamw(1e-2)
    updates, state = opt.update({"w": torch.ones(3), "frozen": None}, opt.init(params), params)
    assert updates["frozen"] is None and state[0].mu["frozen"] is None
    assert optim.apply_updates(params, updates)["frozen"] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "opt",
    [
        optim.adamw(0.1, weight_decay=0.1),
        optim.adam(0.1, nesterov=True),
        optim.sgd(0.1, momentum=0.9),
        optim.lion(0.1),
        optim.chain(optim.clip_by_global_norm(0.5), optim.scale(-1.0)),
    ],
    ids=["adamw", "nadam", "sgd", "lion", "clip"],
)
def test_a_scalar_param_is_updated_as_a_one_element_param(opt, dtype):
    """The 0-d float64 bias corrections and float32 learning rate and clipping factor
    promoted a 0-d leaf: a float32 scalar's Adam update came out float64 (4e-9 off the same
    value held as shape (1,)), a bfloat16 one's float32 or float64 (3e-4 off)."""
    torch.manual_seed(0)
    values = torch.randn(2, 3).to(dtype)
    scalar = {"s": values[0, 0].clone(), "v": values[0]}
    one = {"s": values[0, :1].clone(), "v": values[0]}
    states = [opt.init(scalar), opt.init(one)]
    for step in range(3):
        grads = torch.randn(2, 3).to(dtype)
        (u0, states[0]), (u1, states[1]) = (
            opt.update({"s": grads[0, 0], "v": grads[1]}, states[0], scalar),
            opt.update({"s": grads[0, :1], "v": grads[1]}, states[1], one),
        )
        assert u0["s"].shape == () and u0["s"].dtype == u1["s"].dtype == dtype, step
        assert torch.equal(u0["s"].reshape(1), u1["s"])
        scalar, one = optim.apply_updates(scalar, u0), optim.apply_updates(one, u1)
