"""Checkpoints of steps placed by real transforms: ``tensor_parallel`` x ``shard_params``
(fsdp shards dim 1 of column-parallel weights), and the MoE decoder under ``tensor_parallel``,
restore bitwise under other layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard

import d9d
from d9d import checkpoint
from d9d.models import Llama, LlamaConfig, MoE, MoEConfig
from d9d.testing import assert_trees_all_equal, run_on_ranks

pytestmark = pytest.mark.distributed


def _state() -> tuple[d9d.Model, dict]:
    model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=1, vocab_size=97)))
    opt = d9d.optim.adamw(1e-3)
    return model, {"params": model.params, "opt_state": opt.init(model.params)}


def _identity(params: dict, opt_state: dict, batch: object) -> tuple[dict, dict, dict]:
    return params, opt_state, {}


def _placed(layout: dict[str, int]) -> dict:
    mesh = d9d.make_mesh("cpu", **layout)
    model, tree = _state()
    transforms = []
    if "tp" in layout:
        transforms.append(d9d.tensor_parallel(mesh))
    if "fsdp" in layout:
        transforms.append(d9d.shard_params(mesh, "fsdp"))
    step = _identity
    for transform in transforms:
        step = transform(step)
    params, state = step.place(tree["params"], tree["opt_state"], axes=model.axes)
    return {"params": params, "opt_state": state}


def test_fsdp2_x_tp2_restores_under_fsdp4_and_one_device(tmp_path: Path) -> None:
    """Vocab 97 over tp=2 and dim 1 of the column-parallel weights over fsdp=2: uneven."""

    def save() -> None:
        checkpoint.save(tmp_path, _placed({"fsdp": 2, "tp": 2}), step=1).wait()

    run_on_ranks(save, 4)

    def restore() -> None:
        expected = _placed({"fsdp": 4})
        target = d9d.tree.map(
            lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x, expected
        )
        restored = checkpoint.restore(tmp_path / "step_1", target)
        for got, want in zip(d9d.tree.leaves(restored), d9d.tree.leaves(expected), strict=True):
            if isinstance(want, torch.distributed.tensor.DTensor):
                assert got.placements == want.placements
                assert_trees_all_equal(got.to_local(), want.to_local())

    run_on_ranks(restore, 4)
    _, whole = _state()
    meta = d9d.tree.map(lambda x: torch.empty_like(x, device="meta"), whole)
    assert_trees_all_equal(checkpoint.restore(tmp_path / "step_1", meta), whole)


def _moe_placed(layout: dict[str, int]) -> dict:
    mesh = d9d.make_mesh("cpu", **layout)
    model = d9d.functionalize(MoE(MoEConfig.tiny()))
    transform = d9d.tensor_parallel(mesh) if "tp" in layout else d9d.shard_params(mesh, "fsdp")
    params, _ = transform(_identity).place(model.params, {}, model=model)
    return params


def test_moe_saved_under_tp2_restores_under_fsdp2_and_one_device(tmp_path: Path) -> None:
    """The shared experts are column/row-parallel over tp, the routed experts whole."""

    def save() -> None:
        params = _moe_placed({"tp": 2})
        assert params["layers.1.mlp.shared.w_down.weight"].placements == (Shard(1),)
        checkpoint.save(tmp_path, params, step=1).wait()

    run_on_ranks(save, 2)

    def restore() -> None:
        expected = _moe_placed({"fsdp": 2})
        target = {k: torch.zeros_like(v) for k, v in expected.items()}
        restored = checkpoint.restore(tmp_path / "step_1", target)
        for key, want in expected.items():
            assert restored[key].placements == want.placements
            assert_trees_all_equal(restored[key].to_local(), want.to_local())

    run_on_ranks(restore, 2)
    whole = d9d.functionalize(MoE(MoEConfig.tiny())).params
    meta = {k: torch.empty_like(v, device="meta") for k, v in whole.items()}
    assert_trees_all_equal(checkpoint.restore(tmp_path / "step_1", meta), whole)
