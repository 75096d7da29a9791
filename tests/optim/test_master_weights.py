"""``master_weights``: bfloat16 params that follow ``torch.optim.AdamW`` run on float32 copies."""

from __future__ import annotations

import pytest
import torch

import d9d.optim as optim

SHAPES = {"attn.weight": (5, 3), "mlp.weight": (4, 3, 2), "norm.weight": (6,)}
STEPS = 20


def _grads(generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {path: torch.randn(shape, generator=generator) for path, shape in SHAPES.items()}


def test_bf16_params_are_torch_adamw_on_float32_masters_rounded() -> None:
    """20 steps of random grads: the masters follow ``torch.optim.AdamW`` on float32 params
    fed the same (bfloat16) grads to 1e-6, and each bfloat16 param is its master rounded
    to nearest, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    start = {path: 0.1 * torch.randn(shape, generator=generator) for path, shape in SHAPES.items()}
    reference = {path: p.clone().requires_grad_(True) for path, p in start.items()}
    torch_opt = torch.optim.AdamW(reference.values(), lr=1e-2, weight_decay=0.1)
    opt = optim.master_weights(optim.adamw(1e-2, weight_decay=0.1))
    params = {path: p.to(torch.bfloat16) for path, p in start.items()}
    state = opt.init(params)
    for path, p in reference.items():  # the masters start from the bfloat16 params
        p.data.copy_(params[path].float())
    for step in range(STEPS):
        grads = {k: g.to(torch.bfloat16) for k, g in _grads(generator).items()}
        for path, p in reference.items():
            p.grad = grads[path].float()
        torch_opt.step()
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        for path, p in params.items():
            master = state.master[path]
            assert master.dtype == torch.float32 and p.dtype == torch.bfloat16
            torch.testing.assert_close(master, reference[path].detach(), atol=1e-6, rtol=0)
            assert torch.equal(p, master.to(torch.bfloat16)), f"{path} at {step=}"


def test_masters_keep_updates_that_bf16_loses() -> None:
    """An SGD step of +1e-3 on 1.0 is an eighth of a bfloat16 ulp: lost every step by plain
    bfloat16 params, kept by the masters (1.02 after 20 steps, rounded)."""
    grads = {"w": torch.full((3,), -1e-3, dtype=torch.bfloat16)}
    ends = {}
    for name, opt in {
        "plain": optim.sgd(1.0),
        "master": optim.master_weights(optim.sgd(1.0)),
    }.items():
        params = {"w": torch.ones(3, dtype=torch.bfloat16)}
        state = opt.init(params)
        for _ in range(STEPS):
            updates, state = opt.update(grads, state, params)
            params = optim.apply_updates(params, updates)
        ends[name] = params["w"]
    assert torch.equal(ends["plain"], torch.ones(3, dtype=torch.bfloat16))
    expected = torch.tensor(1.0 + STEPS * 1e-3).to(torch.bfloat16).expand(3)
    assert torch.equal(ends["master"], expected)


def test_wide_params_keep_no_master_and_get_the_inner_update() -> None:
    """A float32 param beside a bfloat16 one: only the bfloat16 one has a master (and float32
    moments); the float32 one is updated as ``adamw`` alone updates it, bit for bit."""
    generator = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(4, 3, generator=generator).bfloat16(), "norm": torch.ones(3)}
    inner = optim.adamw(1e-2, weight_decay=0.1)
    opt = optim.master_weights(inner)
    state, plain_state = opt.init(params), inner.init({"norm": params["norm"]})
    assert set(state.master) == {"w"}
    mu, nu = optim.get_state(state, "mu"), optim.get_state(state, "nu")
    assert mu["w"].dtype == nu["w"].dtype == torch.float32
    plain = {"norm": params["norm"]}
    for _ in range(3):
        grads = {"w": torch.randn(4, 3, generator=generator).bfloat16(), "norm": torch.randn(3)}
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        plain_updates, plain_state = inner.update({"norm": grads["norm"]}, plain_state, plain)
        plain = optim.apply_updates(plain, plain_updates)
    assert torch.equal(params["norm"], plain["norm"])


def test_float64_masters_of_float32_params() -> None:
    params = {"w": torch.tensor([1.0, 2.0])}
    opt = optim.master_weights(optim.sgd(1.0), torch.float64)
    state = opt.init(params)
    updates, state = opt.update({"w": torch.tensor([-1e-9, 0.0])}, state, params)
    assert state.master["w"].dtype == torch.float64
    assert state.master["w"][0].item() == 1.0 + 1e-9  # below float32's ulp at 1.0: kept here
    assert torch.equal(optim.apply_updates(params, updates)["w"], params["w"])


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"master_weights\(\) wraps a GradientTransformation"):
        optim.master_weights(optim.adamw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"4 bytes or more.*dtype=torch.bfloat16"):
        optim.master_weights(optim.sgd(1.0), torch.bfloat16)
    opt = optim.master_weights(optim.sgd(1.0))
    params = {"w": torch.ones(2, dtype=torch.bfloat16)}
    with pytest.raises(
        ValueError, match=r"needs the params: call opt.update\(grads, opt_state, params\)"
    ):
        opt.update(params, opt.init(params))
