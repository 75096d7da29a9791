"""A transformed step refuses bad inputs before any collective of the step: params of the wrong
shape, and ranks passing batches of different shapes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

import d9d
import d9d.core._step
from d9d.cli._train_step import make_train_step
from d9d.core._batch_check import check_batch
from d9d.errors import BatchShapeError, ParamShapeError, PlanError
from d9d.models import Llama, LlamaConfig
from d9d.testing import fake_world, run_on_ranks

pytestmark = pytest.mark.distributed

PATH = "layers.0.mlp.w_up.weight"  # (176, 64) in the tiny Llama


def _setup(**axes: int):
    mesh = d9d.make_mesh("cpu", **axes)
    model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=1)))
    opt = d9d.optim.sgd(0.1)
    shard = d9d.shard_params(mesh, "fsdp", replicate_axis="dp" if "dp" in axes else None)
    return model, opt, shard(make_train_step(model, opt))


def _batch(rows: int = 2, seq_len: int = 8) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 256, (rows, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


@pytest.mark.parametrize("transform", ["shard_params", "remat"])
def test_a_transform_of_a_jitted_step_names_the_order_to_use(transform: str) -> None:
    with fake_world(2):
        mesh = d9d.make_mesh("cpu", fsdp=2)
        model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=1)))
        jitted = d9d.jit(make_train_step(model, d9d.optim.sgd(0.1)))
        rewrite = d9d.shard_params(mesh, "fsdp") if transform == "shard_params" else d9d.remat()
        with pytest.raises(
            PlanError,
            match=rf"{transform} was applied to a step already compiled by d9d\.jit; jit must "
            rf"wrap every transform: put @d9d\.jit above the @d9d\.{transform}\(\.\.\.\)",
        ):
            rewrite(jitted)


def test_param_of_wrong_shape_is_named_by_place_and_by_the_step() -> None:
    with fake_world(2):
        model, opt, step = _setup(fsdp=2)
        bad = {**model.params, PATH: torch.zeros(176, 65)}
        model_says = r"param 'layers\.0\.mlp\.w_up\.weight' has shape \(176, 65\) but the model's"
        with pytest.raises(ParamShapeError, match=model_says + r" is \(176, 64\)"):
            step.place(bad, opt.init(bad), model=model)
        params, state = step.place(bad, opt.init(bad), axes=model.axes)  # the plan trusts them
        with pytest.raises(ParamShapeError, match=model_says):
            step(params, state, _batch(2))

        params, state = step.place(model.params, opt.init(model.params), model=model)
        placements = params[PATH].placements
        params[PATH] = distribute_tensor(torch.zeros(176, 66), step.mesh, placements)
        with pytest.raises(
            ParamShapeError,
            match=r"param 'layers\.0\.mlp\.w_up\.weight' has shape \(176, 66\) but the plan's "
            r"is \(176, 64\); pass the params returned by step\.place",
        ):
            step(params, state, _batch(2))


def test_an_optimizer_state_not_the_placed_one_is_named_by_the_step() -> None:
    """Not a DTensor beside a plain tensor inside the update ("got mixed torch.Tensor and
    DTensor"): the state never placed, or another optimizer's, named with what to pass."""
    with fake_world(2):
        mesh = d9d.make_mesh("cpu", fsdp=2)
        model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=1)))
        opt = d9d.optim.adamw(1e-3)
        step = d9d.shard_params(mesh, "fsdp")(make_train_step(model, opt))
        unplaced = opt.init(model.params)
        params, state = step.place(model.params, unplaced, model=model)
        with pytest.raises(
            PlanError,
            match=r"opt_state leaf '\S+embed\.weight' is a plain tensor but step\.place laid it "
            r"out as a DTensor; pass the opt_state returned by step\.place",
        ):
            step(params, unplaced, _batch(2))
        sgd_state = d9d.optim.sgd(0.1, momentum=0.9).init(model.params)
        with pytest.raises(PlanError, match=r"opt_state has \d+ leaves but the one step\.place"):
            step(params, sgd_state, _batch(2))
        step(params, state, _batch(2))


def test_ranks_passing_batches_of_different_shapes_are_named_on_the_first_call() -> None:
    def rank() -> None:
        model, opt, step = _setup(dp=2, fsdp=2)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        with pytest.raises(
            BatchShapeError,
            match=r"rank 0 \(dp=0, fsdp=0\) passes \{labels: int64\[2, 8\], tokens: int64\[2, 8\]\} "
            r"but rank 3 \(dp=1, fsdp=1\) passes \{labels: int64\[3, 8\], tokens: int64\[3, 8\]\}; "
            r"every rank must pass a batch of the same shapes",
        ):
            step(params, state, _batch(3 if dist.get_rank() == 3 else 2))

    run_on_ranks(rank, 4)


def test_batch_shapes_are_checked_again_only_when_they_change(monkeypatch) -> None:
    checks = []

    def counting_check(batch, mesh) -> None:
        checks.append(dist.get_rank())
        check_batch(batch, mesh)

    monkeypatch.setattr(d9d.core._step, "check_batch", counting_check)

    def rank() -> None:
        model, opt, step = _setup(fsdp=2)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        params, state, _ = step(params, state, _batch())
        params, state, _ = step(params, state, _batch())
        with pytest.raises(BatchShapeError, match=r"tokens: int64\[2, 4\].*tokens: int64\[2, 6\]"):
            step(params, state, _batch(seq_len=4 if dist.get_rank() == 0 else 6))

    run_on_ranks(rank, 2)
    assert sorted(checks) == [0, 0, 1, 1], "one check on the first call, one on the change"
