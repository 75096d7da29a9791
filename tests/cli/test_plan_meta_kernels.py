"""``d9d plan``'s cache of meta kernels: what it answers, what it leaves to the kernel, and
that a plan is the same with it and without it."""

from __future__ import annotations

import contextlib

import pytest
import torch

import d9d
from d9d.cli.plan import _dry_run
from d9d.cli.plan._dry_run import dry_run
from d9d.cli.plan._measured_step import plan_step
from d9d.cli.plan._meta_kernels import MetaKernelCache
from d9d.cli.plan._show import show_plan
from d9d.models import MoE, MoEConfig
from d9d.testing import fake_world


def test_a_repeated_op_is_answered_with_the_kernels_shapes_strides_and_dtype() -> None:
    a = torch.empty(3, 5, 7, device="meta").permute(2, 0, 1)  # strided, not contiguous
    b = torch.empty(7, 1, 5, dtype=torch.float64, device="meta")
    with MetaKernelCache() as cache:
        first = torch.add(a, b)
        second = torch.add(a, b)
    assert (cache.calls, cache.hits) == (2, 1)
    expected = torch.add(a, b)  # the kernel's, outside the cache
    for out in (first, second):
        assert (out.shape, out.stride(), out.dtype) == (
            expected.shape,
            expected.stride(),
            expected.dtype,
        )
        assert out.untyped_storage().nbytes() == expected.untyped_storage().nbytes()
    assert second.untyped_storage()._cdata != first.untyped_storage()._cdata


def test_views_writes_and_tensors_off_meta_run_their_kernel() -> None:
    a = torch.empty(4, 6, device="meta")
    cpu = torch.ones(4, 6)
    with MetaKernelCache() as cache:
        for _ in range(2):
            view = a.view(24)
            a.mul_(2.0)
            doubled = cpu * 2
    assert cache.calls == 6 and cache.hits == 0
    assert view.untyped_storage()._cdata == a.untyped_storage()._cdata
    assert torch.equal(doubled, torch.full((4, 6), 2.0))


def _dry_run_cache(n_layers: int, monkeypatch: pytest.MonkeyPatch) -> MetaKernelCache:
    caches: list[MetaKernelCache] = []

    class Recorded(MetaKernelCache):
        def __init__(self) -> None:
            super().__init__()
            caches.append(self)

    monkeypatch.setattr(_dry_run, "MetaKernelCache", Recorded)
    sizes = {"dp": 1, "fsdp": 2, "tp": 1, "cp": 1, "pp": 1, "ep": 1}
    with fake_world(2):
        with torch.device("meta"):
            model = d9d.functionalize(MoE(MoEConfig.tiny(n_layers=n_layers)))
        step, opt = plan_step(model, sizes, "moe", None, "none", "1f1b", 1)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
        dry_run(step, params, state, {"tokens": tokens, "labels": tokens})
    return caches[-1]


def test_identical_blocks_run_few_more_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two more MoE blocks alike (about 2,000 more ops in the dry run) run 2 more meta
    kernels, not one per op: the cache answers the rest (what remains: ops on each layer's
    slice of the expert loads, at its own offset, and stacks over all layers)."""
    small, large = _dry_run_cache(3, monkeypatch), _dry_run_cache(5, monkeypatch)
    added_ops, added_kernels = large.calls - small.calls, large.kernels - small.kernels
    print(f"2 more blocks: {added_ops} ops, {added_kernels} kernels run")
    assert added_ops > 1000 and added_kernels * 100 < added_ops


@pytest.mark.parametrize(
    "options",
    [
        dict(preset="small", model="moe", pp=2, ep=2, schedule="zbv", remat="full"),
        dict(preset="tiny", tp=2, fsdp=2, remat="selective"),
    ],
    ids=["moe pp=2 zbv x ep=2 full", "llama tp=2 x fsdp=2 selective"],
)
def test_a_plan_is_the_same_without_the_cache(
    options: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = show_plan(**options, seq=32, max_rows=None)
    monkeypatch.setattr(_dry_run, "MetaKernelCache", contextlib.nullcontext)
    assert show_plan(**options, seq=32, max_rows=None) == cached
