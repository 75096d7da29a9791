"""A checkpoint saved under ``pipeline(pp=2)`` (each rank writing its stage's params and AdamW
state) restores bitwise under ``pp=4`` and on one device.

Ranks are threads: placing and checkpointing need no point-to-point ops, and tensorstore's
thread pools do not survive a fork of a process that has used them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from equivalence import llama, optimizer

import d9d
from d9d import checkpoint
from d9d.testing import assert_trees_all_equal, run_on_ranks

pytestmark = pytest.mark.distributed


def _state(**config: bool) -> tuple[d9d.Model, dict]:
    """A tiny Llama's params and an AdamW state whose moments are random, not zeros."""
    model = llama(torch.float32, 4, **config)()
    state = optimizer().init(model.params)
    g = torch.Generator().manual_seed(1)
    state = d9d.tree.map(
        lambda x: torch.rand(x.shape, generator=g) if x.is_floating_point() else x + 3, state
    )
    return model, {"params": model.params, "opt_state": state}


def _placed(pp: int, **config: bool) -> dict:
    mesh = d9d.make_mesh("cpu", pp=pp)
    model, whole = _state(**config)
    step = d9d.pipeline(mesh, microbatches=2)(lambda p, s, b: (p, s, {}))
    params, state = step.place(whole["params"], whole["opt_state"], model=model)
    return {"params": params, "opt_state": state}


def _by_path(tree: dict) -> dict[str, torch.Tensor]:
    pairs, _ = d9d.tree.flatten_with_paths(tree)
    return {
        path: (leaf.full_tensor() if isinstance(leaf, torch.distributed.tensor.DTensor) else leaf)
        for path, leaf in pairs
        if isinstance(leaf, torch.Tensor)
    }


def test_pp2_checkpoint_restores_under_pp4_and_one_device(tmp_path: Path) -> None:
    def save() -> int:
        placed = _placed(2)
        checkpoint.save(tmp_path, placed, step=2).wait()
        return len(placed["params"])

    held = run_on_ranks(save, 2)
    _, whole = _state()
    expected = _by_path(whole)
    assert sum(held) == len(whole["params"])

    def restore() -> tuple[dict[str, torch.Tensor], int]:
        target = d9d.tree.map(
            lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x, _placed(4)
        )
        # Each rank reads its stages only: the checkpoint holds every stage.
        restored = checkpoint.restore(tmp_path / "step_2", target, partial=True)
        return _by_path(restored), len(restored["params"])

    counts = []
    for leaves, count in run_on_ranks(restore, 4):
        assert_trees_all_equal(leaves, {k: expected[k] for k in leaves})
        counts.append(count)
    assert sum(counts) == len(whole["params"])
    meta = d9d.tree.map(lambda x: torch.empty_like(x, device="meta"), whole)
    assert_trees_all_equal(_by_path(checkpoint.restore(tmp_path / "step_2", meta)), expected)


def test_a_head_tied_to_the_embedding_is_written_once_and_restores_on_every_stage(
    tmp_path: Path,
) -> None:
    """Both end stages hold the tied ``embed.weight`` and its state, each on its own one-rank
    mesh: only the first stage's writes it (both created its array before, and the save
    failed with ALREADY_EXISTS)."""

    def save() -> None:
        checkpoint.save(tmp_path, _placed(2, tie_embeddings=True), step=1).wait()

    run_on_ranks(save, 2)
    _, whole = _state(tie_embeddings=True)
    expected = _by_path(whole)

    def restore() -> dict[str, torch.Tensor]:
        target = d9d.tree.map(torch.zeros_like, _placed(2, tie_embeddings=True))
        return _by_path(checkpoint.restore(tmp_path / "step_1", target, partial=True))

    for leaves in run_on_ranks(restore, 2):
        assert "params.embed.weight" in leaves
        assert_trees_all_equal(leaves, {k: expected[k] for k in leaves})
    meta = d9d.tree.map(lambda x: torch.empty_like(x, device="meta"), whole)
    assert_trees_all_equal(_by_path(checkpoint.restore(tmp_path / "step_1", meta)), expected)
