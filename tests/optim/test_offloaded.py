"""``offloaded``: the wrapped optimizer's update, run where its state is, equals it bitwise.

The state's device here is the grads' (the CPU), so nothing is copied; the distributed
tests (tests/distributed/test_host_state.py) run it on placed DTensors with their shards on
the plan's state device."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from d9d import optim, tree
from d9d.errors import PlanError
from d9d.testing import run_on_ranks


def _params(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(5, 3, generator=g).to(dtype),
        "b": torch.randn(7, generator=g).to(dtype),
    }


def _grads(step: int, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step + 1)
    return {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in params.items()}


def _run(opt: optim.GradientTransformation, params: dict[str, torch.Tensor], steps: int = 4):
    state = opt.init(params)
    for step in range(steps):
        updates, state = opt.update(_grads(step, params), state, params)
        params = optim.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize(
    ("name", "build", "dtype"),
    [
        (
            "adamw",
            lambda: optim.adamw(optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.1),
            torch.float32,
        ),
        ("lion", lambda: optim.lion(1e-3, weight_decay=0.1), torch.float32),
        ("sgd momentum", lambda: optim.sgd(0.1, momentum=0.9), torch.float32),
        (
            "bf16 moments",
            lambda: optim.adamw(1e-2, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16),
            torch.float32,
        ),
        ("master weights", lambda: optim.master_weights(optim.adamw(1e-2)), torch.bfloat16),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_equals_the_wrapped_optimizer_bitwise(name: str, build, dtype: torch.dtype) -> None:
    expected, expected_state = _run(build(), _params(dtype))
    got, state = _run(optim.offloaded(build()), _params(dtype))
    assert isinstance(state, optim.OffloadedState)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    for a, b in zip(tree.leaves(state.inner_state), tree.leaves(expected_state), strict=True):
        assert torch.equal(a, b)


def test_clipping_before_it_runs_on_the_grads() -> None:
    """``chain(clip, offloaded(adamw))``: the clip sees every grad, as without the wrapper."""
    expected, _ = _run(optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(1e-2)), _params())
    got, _ = _run(
        optim.chain(optim.clip_by_global_norm(0.1), optim.offloaded(optim.adamw(1e-2))), _params()
    )
    for key in expected:
        assert torch.equal(got[key], expected[key])


def test_refusals() -> None:
    with pytest.raises(TypeError, match=r"offloaded\(\) wraps a GradientTransformation, got"):
        optim.offloaded(optim.adamw)  # type: ignore[arg-type]
    opt = optim.offloaded(optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1)))
    params = _params()
    with pytest.raises(
        PlanError, match=r"global_norm \(clip_by_global_norm\) runs inside d9d.optim.offloaded"
    ):
        opt.update(_grads(0, params), opt.init(params), params)
    # The refusal ends with the update that raised it.
    assert float(optim.global_norm({"w": torch.ones(4)})) == 2.0


def test_stochastic_round_wraps_it_and_is_refused_inside_it() -> None:
    """Inside, the rounding would see this rank's shards as whole params: every rank's
    shard drew the bits of the param's first elements. Outside, it rounds on the device."""
    sgd = optim.sgd(0.1, momentum=0.9)
    expected, _ = _run(optim.stochastic_round(sgd, seed=1), _params(torch.bfloat16))
    got, _ = _run(optim.stochastic_round(optim.offloaded(sgd), seed=1), _params(torch.bfloat16))
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    opt = optim.offloaded(optim.stochastic_round(sgd))
    params = _params(torch.bfloat16)
    with pytest.raises(
        PlanError,
        match=r"stochastic_round runs inside d9d.optim.offloaded.*stochastic_round\(offloaded\(",
    ):
        opt.update(_grads(0, params), opt.init(params), params)


def _shape_masked_rank() -> list[torch.Tensor]:
    """adamw with a mask decided from shapes, on params sharded Shard(0) over 2 ranks: the
    device update and the offloaded one, whose inner update sees this rank's shards."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    params = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _params().items()}
    grads = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _grads(0, _params()).items()}

    def build() -> optim.GradientTransformation:  # decays "a.weight" (5 rows), not "b"
        return optim.adamw(1e-2, weight_decay=0.5, mask=lambda path, p: p.shape[0] == 5)

    results = []
    for opt in (build(), optim.offloaded(build())):
        updates, _ = opt.update(grads, opt.init(params), params)
        results.append(updates["a.weight"].full_tensor())
    return results


def test_a_mask_decided_from_shapes_sees_the_whole_params_shape() -> None:
    """Inside offloaded a mask callable is shown the whole param's shape, not the shard's
    (3 or 2 of 5 rows here): the shard-shaped mask decayed nothing on the host, silently."""
    for device, host in run_on_ranks(_shape_masked_rank, 2):
        assert torch.equal(host, device)
