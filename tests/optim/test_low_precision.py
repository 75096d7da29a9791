"""Low-precision optimizer state and params: bfloat16 moments (``mu_dtype``/``nu_dtype``)
against ``torch.optim.AdamW`` in float32, and ``stochastic_round`` (unbiased, always one of
the two neighbouring bfloat16 values, the same bits on a sharded param as on one device)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import d9d.optim as optim
from d9d.testing import run_on_ranks

SHAPES = {"a.bias": (7,), "a.weight": (6, 3), "b.weight": (5, 4, 3)}


def _tree(generator: torch.Generator, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {path: scale * torch.randn(shape, generator=generator) for path, shape in SHAPES.items()}


def test_bfloat16_moments_follow_torch_adamw_in_float32() -> None:
    """10 steps: params within 2e-4 of torch's float32 AdamW (lr 1e-2: each step moves a
    param by about 1e-2, and a bfloat16 moment is off by at most 2**-9 of itself)."""
    generator = torch.Generator().manual_seed(0)
    params = _tree(generator)
    reference = {path: p.clone().requires_grad_(True) for path, p in params.items()}
    torch_opt = torch.optim.AdamW(reference.values(), lr=1e-2, weight_decay=0.1)
    opt = optim.adamw(1e-2, weight_decay=0.1, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16)
    state = opt.init(params)
    for _ in range(10):
        grads = _tree(generator, scale=3.0)
        for path, p in reference.items():
            p.grad = grads[path].clone()
        torch_opt.step()
        updates, state = opt.update(grads, state, params)
        assert all(u.dtype == torch.float32 for u in updates.values())
        params = optim.apply_updates(params, updates)
    adam_state = state[0]
    for path, p in params.items():
        assert p.dtype == torch.float32
        assert adam_state.mu[path].dtype == adam_state.nu[path].dtype == torch.bfloat16
        torch.testing.assert_close(p, reference[path].detach(), rtol=0, atol=2e-4)
        # A bfloat16 moment is rounded at each step (2**-9 of itself): the errors add up to
        # a few 2**-9 of the moment's scale, not of a moment that has cancelled to near 0.
        for ours, theirs in ((adam_state.mu, "exp_avg"), (adam_state.nu, "exp_avg_sq")):
            want = torch_opt.state[reference[path]][theirs]
            scale = want.abs().max().item()
            torch.testing.assert_close(ours[path].float(), want, rtol=0, atol=4 * 2**-9 * scale)


def test_float32_moments_of_float32_params_are_the_default_bitwise() -> None:
    generator = torch.Generator().manual_seed(1)
    params, grads = _tree(generator), _tree(generator)
    default, upcast = optim.adamw(1e-2), optim.adamw(1e-2, mu_dtype=torch.float32)
    got = default.update(grads, default.init(params), params)
    want = upcast.update(grads, upcast.init(params), params)
    for path in params:
        assert torch.equal(got[0][path], want[0][path])
        assert torch.equal(got[1][0].nu[path], want[1][0].nu[path])


def test_mixed_state_dtypes_and_bfloat16_params() -> None:
    """bfloat16 params with float32 moments: the state is float32 and the math too (the
    update is float32), where the default keeps bfloat16 moments."""
    params = {"w": torch.ones(3, dtype=torch.bfloat16)}
    grads = {"w": torch.tensor([1.0, -2.0, 3.0], dtype=torch.bfloat16)}
    opt = optim.adam(0.1, mu_dtype=torch.float32, nu_dtype=torch.float32)
    updates, state = opt.update(grads, opt.init(params), params)
    assert state[0].mu["w"].dtype == state[0].nu["w"].dtype == torch.float32
    assert updates["w"].dtype == torch.float32
    torch.testing.assert_close(updates["w"], torch.tensor([-0.1, 0.1, -0.1]))
    assert optim.adam(0.1).init(params)[0].mu["w"].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, "bfloat16"])
def test_state_dtype_errors_name_the_value(dtype) -> None:
    with pytest.raises(
        ValueError, match=r"mu_dtype=.* 8-bit state needs per-block scales|mu_dtype='bfloat16'"
    ):
        optim.adamw(1e-3, mu_dtype=dtype)


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values just below and just above each float32 ``x`` (as float32)."""
    nearest = x.to(torch.bfloat16)
    up = torch.nextafter(nearest, torch.tensor(math.inf, dtype=torch.bfloat16))
    down = torch.nextafter(nearest, torch.tensor(-math.inf, dtype=torch.bfloat16))
    below = torch.where(nearest.float() <= x, nearest, down).float()
    above = torch.where(nearest.float() >= x, nearest, up).float()
    return below, above


def test_rounding_is_unbiased_and_lands_on_a_neighbour() -> None:
    """2**16 draws per value, one per possible bit pattern, over every exponent in
    [-20, 20], both signs and bfloat16 values: the mean is the float32 value exactly (uniform
    bits are unbiased without statistics), and each result is one of the neighbours."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(64, generator=generator) * torch.pow(2.0, torch.arange(-20, 44) % 41 - 20)
    x[:4] = torch.tensor([1.0, -2.5, 3.0 + 2**-6, 0.0])  # bfloat16 values stay
    bits = torch.arange(1 << 16).repeat(len(x), 1)
    rounded = optim.stochastic_round_to_bfloat16(x[:, None].expand_as(bits), bits)
    assert rounded.dtype == torch.bfloat16
    below, above = _neighbours(x)
    values = rounded.float()
    assert bool(((values == below[:, None]) | (values == above[:, None])).all())
    torch.testing.assert_close(values.double().mean(1), x.double(), rtol=1e-7, atol=0)
    assert bool((values[:4] == x[:4, None]).all())


@pytest.mark.parametrize("fraction", [0.5, 0.125, 2**-6])
def test_wrapper_is_unbiased_over_steps_and_elements(fraction: float) -> None:
    """An update of ``fraction`` of an ulp at 1.0 (2**-7): round-to-nearest loses it;
    stochastic rounding moves the mean by it, within 5 standard
    errors over 16384 elements x 32 steps, with the variance of a Bernoulli(fraction) ulp."""
    ulp = 2.0**-7
    params = {"w": torch.ones(128, 128, dtype=torch.bfloat16)}
    opt = optim.stochastic_round(optim.scale(1.0), seed=3)
    state = opt.init(params)
    ups = []
    for _ in range(32):  # the params stay: each step redraws the bits of the same sum
        updates, state = opt.update({"w": torch.full((128, 128), fraction * ulp)}, state, params)
        new = optim.apply_updates(params, updates)["w"].float()
        assert bool(((new == 1.0) | (new == 1.0 + ulp)).all())
        ups.append((new == 1.0 + ulp).double())
    up = torch.stack(ups)
    count = up.numel()
    standard_error = math.sqrt(fraction * (1 - fraction) / count)
    assert abs(up.mean().item() - fraction) < 5 * standard_error
    assert abs(up.var().item() - fraction * (1 - fraction)) < 5 * standard_error
    per_step = up.mean((1, 2))  # no step draws the same bits as another
    assert per_step.std().item() < 5 * math.sqrt(fraction * (1 - fraction) / (128 * 128))
    nearest = optim.apply_updates(params, {"w": torch.full((128, 128), fraction * ulp)})
    assert bool((nearest["w"] == 1.0).all())  # to nearest (a tie to even at 0.5): lost


def test_applied_update_lands_on_the_stochastically_rounded_sum() -> None:
    """``apply_updates(p, update)`` is exactly ``stochastic_round_to_bfloat16(p + u)`` with
    the wrapper's bits, for params over exponents -30..30 and updates from 1e-3 to 1e3 of them."""
    from d9d.optim._stochastic_rounding import _global_index, _mix, _path_salt

    generator = torch.Generator().manual_seed(6)
    n = 100_000
    exponents = torch.randint(-30, 30, (n,), generator=generator).float()
    params = {"w": (torch.randn(n, generator=generator) * torch.pow(2.0, exponents)).bfloat16()}
    opt = optim.stochastic_round(optim.scale(1.0), seed=9)
    index = _global_index((n,), (0,), (n,), torch.device("cpu"))
    key = _mix(_mix(_mix(torch.tensor(1)) ^ 9) ^ _path_salt("w"))
    bits = _mix(_mix(index ^ key) ^ (index >> 32)) & 0xFFFF
    for scale in (1e-3, 1.0, 1e3):
        u = torch.randn(n, generator=generator) * params["w"].float().abs() * scale
        updates, _ = opt.update({"w": u}, opt.init(params), params)
        new = optim.apply_updates(params, updates)["w"]
        want = optim.stochastic_round_to_bfloat16(params["w"].float() + u, bits)
        assert torch.equal(new, want), scale


def test_wrapper_passes_float32_params_and_refuses_float16() -> None:
    params = {"w": torch.ones(3), "b": torch.ones(2, dtype=torch.bfloat16)}
    opt = optim.stochastic_round(optim.sgd(0.5))
    grads = {"w": torch.ones(3), "b": torch.ones(2, dtype=torch.bfloat16)}
    updates, state = opt.update(grads, opt.init(params), params)
    assert torch.equal(updates["w"], torch.full((3,), -0.5))
    assert torch.equal(updates["b"], torch.full((2,), -0.5))  # 0.5 is a bfloat16 value
    assert int(state.count) == 1
    with pytest.raises(ValueError, match=r"param 'h' is float16 .* store it in bfloat16"):
        opt.init({"h": torch.ones(2, dtype=torch.float16)})
    with pytest.raises(ValueError, match=r"its update needs them: call opt.update\(grads"):
        opt.update(grads, opt.init(params))
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32\), got seed=-1"):
        optim.stochastic_round(optim.sgd(0.5), seed=-1)
    with pytest.raises(TypeError, match=r"wraps a GradientTransformation, got 0.5"):
        optim.stochastic_round(0.5)


def _sharded_and_whole() -> list[str]:
    """Three steps of stochastic_round(adamw) on params sharded over a 2x2 mesh (uneven
    ``Shard(0)``, ``Shard(1)``, nested shards of one dim, ``Replicate``) and on whole params:
    bitwise equal params and state."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    placements = {
        "a.bias": [Shard(0), Shard(0)],
        "a.weight": [Shard(1), Replicate()],
        "b.weight": [Replicate(), Shard(2)],
    }
    generator = torch.Generator().manual_seed(4)
    whole = {p: x.to(torch.bfloat16) for p, x in _tree(generator).items()}
    sharded = {p: distribute_tensor(x, mesh, placements[p]) for p, x in whole.items()}
    opt = optim.stochastic_round(optim.adamw(1e-3, mu_dtype=torch.float32), seed=5)
    whole_state, sharded_state = opt.init(whole), opt.init(sharded)
    for _ in range(3):
        grads = _tree(generator)
        updates, whole_state = opt.update(grads, whole_state, whole)
        whole = optim.apply_updates(whole, updates)
        placed = {p: distribute_tensor(g, mesh, placements[p]) for p, g in grads.items()}
        updates, sharded_state = opt.update(placed, sharded_state, sharded)
        sharded = optim.apply_updates(sharded, updates)
    failures = []
    for path, x in sharded.items():
        assert isinstance(x, DTensor) and x.dtype == torch.bfloat16
        if not torch.equal(x.full_tensor(), whole[path]):
            failures.append(f"{path} differs")
    start = _tree(torch.Generator().manual_seed(4))["a.weight"].to(torch.bfloat16)
    if torch.equal(whole["a.weight"], start):
        failures.append("nothing moved")
    return failures


@pytest.mark.distributed
def test_sharded_params_round_bitwise_as_one_device() -> None:
    assert run_on_ranks(_sharded_and_whole, 4) == [[], [], [], []]


@pytest.mark.compile  # backend "eager": Dynamo tracing and guards only
def test_compiled_low_precision_step_traces_once_and_equals_eager() -> None:
    """bfloat16 moments and stochastic rounding under ``torch.compile(fullgraph=True)``: one
    graph over three steps (the step count is a tensor in the hash key), bitwise as eager."""
    opt = optim.stochastic_round(optim.adamw(1e-2, mu_dtype=torch.bfloat16), seed=7)

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    graphs = []

    def counting_backend(graph_module: torch.fx.GraphModule, example_inputs: list):
        graphs.append(graph_module)
        return graph_module.forward

    generator = torch.Generator().manual_seed(8)
    params = {p: x.to(torch.bfloat16) for p, x in _tree(generator).items()}
    eager, eager_state = params, opt.init(params)
    state = opt.init(params)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=counting_backend, fullgraph=True)
    try:
        for _ in range(3):
            grads = {p: g.to(torch.bfloat16) for p, g in _tree(generator).items()}
            params, state = compiled(params, state, grads)
            eager, eager_state = step(eager, eager_state, grads)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1, f"traced {len(graphs)} graphs in 3 steps; the step recompiled"
    torch.testing.assert_close(params, eager, atol=0, rtol=0)
    torch.testing.assert_close(state, eager_state, atol=0, rtol=0)


def _tiny_bf16_run(fsdp: int | None) -> tuple[list[float], dict[str, str]]:
    """3 steps of the tiny Llama with bf16 params and stochastic rounding, under
    ``shard_params`` on ``fsdp`` ranks (None: one device, untransformed)."""
    import d9d
    from d9d.cli._train_step import make_train_step
    from d9d.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = d9d.functionalize(Llama(LlamaConfig.tiny()))
    params = {path: p.to(torch.bfloat16) for path, p in model.params.items()}
    opt = optim.stochastic_round(optim.adamw(1e-2, mu_dtype=torch.float32), seed=1)
    step = make_train_step(model, opt)
    state = opt.init(params)
    if fsdp is not None:
        step = d9d.shard_params(d9d.make_mesh("cpu", fsdp=fsdp))(step)
        params, state = step.place(params, state)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    rank = torch.distributed.get_rank() if fsdp is not None else 0
    share = slice(None) if fsdp is None else slice(2 * rank, 2 * rank + 2)
    batch = {"tokens": tokens[share, :-1], "labels": tokens[share, 1:]}
    losses = []
    for _ in range(3):
        params, state, metrics = step(params, state, batch)
        losses.append(float(metrics["loss"]))
    kinds = {path: f"{type(p).__name__} {p.dtype}" for path, p in params.items() if "norm" in path}
    return losses, kinds


@pytest.mark.distributed
def test_bf16_params_with_stochastic_rounding_under_shard_params() -> None:
    """The wrapper in a sharded step: params stay bf16 DTensors, and the losses follow one
    device's within 2e-3 (measured 7e-4 at step 3; not bitwise: bf16 grads are summed over
    2 ranks)."""
    whole, _ = _tiny_bf16_run(None)
    for losses, kinds in run_on_ranks(_tiny_bf16_run, 2, 2):
        assert set(kinds.values()) == {"DTensor torch.bfloat16"}
        assert all(math.isclose(a, b, rel_tol=2e-3) for a, b in zip(losses, whole, strict=True))
        assert losses[-1] < losses[0]
