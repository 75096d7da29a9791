"""A checkpoint saved under ``pipeline(pp=2)`` (each rank writing its stage's params and AdamW
state) restores bitwise under ``pp=4`` and on one device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from equivalence import batches, llama, optimizer, train_step

import d9d
from d9d import checkpoint
from d9d.testing import assert_trees_all_equal, run_on_ranks

pytestmark = pytest.mark.distributed

BUILD = llama(torch.float32, 4)


def _placed(pp: int) -> tuple[d9d.TransformedStep, dict]:
    mesh = d9d.make_mesh("cpu", pp=pp)
    model, opt = BUILD(), optimizer()
    step = d9d.pipeline(mesh, microbatches=2)(train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    return step, {"params": params, "opt_state": state}


def _by_path(tree: dict) -> dict[str, torch.Tensor]:
    pairs, _ = d9d.tree.flatten_with_paths(tree)
    return {
        path: (leaf.full_tensor() if isinstance(leaf, torch.distributed.tensor.DTensor) else leaf)
        for path, leaf in pairs
        if isinstance(leaf, torch.Tensor)
    }


def _train_and_save(directory: Path) -> dict[str, torch.Tensor]:
    step, tree = _placed(2)
    params, state = tree["params"], tree["opt_state"]
    for batch in batches(256, steps=2):
        params, state, _ = step(params, state, batch)
    saved = {"params": params, "opt_state": state}
    checkpoint.save(directory, saved, step=2).wait()
    return _by_path(saved)


def _restore_pp4(directory: Path) -> tuple[dict[str, torch.Tensor], int]:
    _, target = _placed(4)
    # Each rank reads its stages only: the checkpoint holds every stage.
    restored = checkpoint.restore(directory / "step_2", target, partial=True)
    return _by_path(restored), len(restored["params"])


def test_pp2_checkpoint_restores_under_pp4_and_one_device(tmp_path: Path) -> None:
    saved: dict[str, torch.Tensor] = {}
    for rank_leaves in run_on_ranks(_train_and_save, 2, tmp_path, method="fork"):
        saved.update(rank_leaves)
    model = BUILD()
    assert {k for k in saved if k.startswith("params.")} == {f"params.{k}" for k in model.params}
    counts = []
    for leaves, held in run_on_ranks(_restore_pp4, 4, tmp_path, method="fork"):
        assert_trees_all_equal(leaves, {k: saved[k] for k in leaves})
        counts.append(held)
    assert sum(counts) == len(model.params)
    whole = {"params": model.params, "opt_state": optimizer().init(model.params)}
    meta = d9d.tree.map(lambda x: torch.empty_like(x, device="meta"), whole)
    assert_trees_all_equal(_by_path(checkpoint.restore(tmp_path / "step_2", meta)), saved)
