"""The store keys through which the ranks of a save meet are that save's alone."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import pytest
import torch
from checkpoint_trees import place

from d9d import checkpoint
from d9d.errors import CheckpointSaveError
from d9d.testing import run_on_ranks


@pytest.mark.distributed
def test_a_nonce_drawn_again_never_reads_an_earlier_save_s_outcomes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keys were named by rank 0's 32-bit nonce alone and are never deleted: a later save
    of the same store that drew the same nonce (odds n**2 / 2**33 over n saves) read the
    earlier one's "rank 1: ok" and committed without waiting for rank 1, here a rank 1 whose
    write then fails: step 2 committed, its rank-1 shard never written."""
    from d9d.checkpoint import _commit

    monkeypatch.setattr(secrets, "token_hex", lambda n: "ab" * n)  # every draw the same
    write = _commit.WriteJob._write

    def late_and_failing(job: _commit.WriteJob) -> None:
        if job.rank == 1 and job.meta["step"] == 2:
            deadline = time.monotonic() + 1.5
            while not job.final.exists() and time.monotonic() < deadline:
                time.sleep(0.01)  # long enough for rank 0 to commit, if it does not wait
            raise OSError("disk full")
        write(job)

    monkeypatch.setattr(_commit.WriteJob, "_write", late_and_failing)

    def save_twice() -> str:
        tree, _ = place({"w": torch.arange(8.0)}, "fsdp=2")
        checkpoint.save(tmp_path, tree, step=1).wait()
        try:
            checkpoint.save(tmp_path, tree, step=2).wait()
        except CheckpointSaveError as error:
            return str(error)
        return "committed"

    outcomes = run_on_ranks(save_twice, 2)
    assert all("rank 1: OSError: disk full" in o for o in outcomes), outcomes
    assert checkpoint.all_checkpoints(tmp_path) == [tmp_path / "step_1"]
