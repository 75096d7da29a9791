"""Train state: params, optimizer state, step, data position and RNG come back together."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_trees import TREE, place

from d9d import checkpoint
from d9d.errors import CheckpointMismatchError
from d9d.testing import assert_trees_all_equal, run_on_ranks


def test_round_trip_restores_rng_and_data(tmp_path: Path) -> None:
    torch.manual_seed(123)
    path = checkpoint.save_train_state(
        tmp_path,
        step=7,
        params=TREE["params"],
        opt_state=TREE["opt_state"],
        data={"step": 7, "epoch": 0},
        metadata={"note": "hi"},
    ).wait()
    expected_draw = torch.rand(4)
    torch.manual_seed(999)
    zeros = {k: torch.zeros_like(v) for k, v in TREE["params"].items()}
    state = checkpoint.restore_train_state(path, params=zeros, opt_state=TREE["opt_state"])
    assert torch.equal(torch.rand(4), expected_draw)
    assert state.step == 7 and state.data == {"step": 7, "epoch": 0}
    assert state.metadata == {"note": "hi"}
    assert_trees_all_equal((state.params, state.opt_state), (TREE["params"], TREE["opt_state"]))


def test_plain_checkpoint_is_not_a_train_state(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, {"params": {}, "opt_state": ()}, step=1).wait()
    with pytest.raises(CheckpointMismatchError, match=r"not written by save_train_state"):
        checkpoint.restore_train_state(path, params={}, opt_state=())


@pytest.mark.distributed
def test_rng_of_every_rank_is_saved_and_world_size_must_match(tmp_path: Path) -> None:
    def save() -> None:
        params, _ = place({"w": torch.arange(6.0)}, "fsdp=2")
        checkpoint.save_train_state(tmp_path, step=1, params=params, opt_state=()).wait()

    run_on_ranks(save, 2)
    meta = checkpoint.metadata(tmp_path / "step_1")
    assert len(meta["metadata"]["rng"]) == 2
    with pytest.raises(CheckpointMismatchError, match=r"RNG states of 2 ranks and this run has 1"):
        checkpoint.restore_train_state(
            tmp_path / "step_1", params={"w": torch.zeros(6)}, opt_state=()
        )
    state = checkpoint.restore_train_state(
        tmp_path / "step_1", params={"w": torch.zeros(6)}, opt_state=(), restore_rng=False
    )
    assert state.params["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
