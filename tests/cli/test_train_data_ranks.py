"""``d9d train`` under ``torchrun``: every rank reads the same tokens, or none trains."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch.distributed as dist

from d9d.cli.train._data import training_tokens
from d9d.errors import DataError
from d9d.testing import run_on_ranks


def _read_and_report(folders: list[Path]) -> str:
    try:
        tokens = training_tokens(folders[dist.get_rank()])
    except DataError as error:
        return str(error)
    return f"{tokens.size} tokens"


def test_ranks_reading_other_copies_of_the_data_are_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    # Node-local copies of --data that differ (rank 2's edited since): each rank cut its
    # rows from its own stream, so the job trained on rows one device never reads, silently.
    folders = [tmp_path / f"node{rank}" for rank in range(3)]
    for folder in folders:
        folder.mkdir()
        (folder / "a.txt").write_text("hello d9d " * 30)
    (folders[2] / "a.txt").write_text("HELLO D9D " * 30)
    messages = run_on_ranks(_read_and_report, 3, folders)
    for rank, message in enumerate(messages):
        assert message.startswith(f"the ranks read different tokens from --data '{folders[rank]}'")
        assert "(ranks [0, 1]: 300 tokens, tokens_digest " in message
        assert "; ranks [2]: 300 tokens, tokens_digest " in message
        assert message.endswith(
            "each cuts its rows from its own: give every node the same copy (a shared folder)"
        )


def test_ranks_reading_the_same_tokens_train_on(tmp_path: Path) -> None:
    np.arange(600, dtype=np.uint16).tofile(tmp_path / "train.bin")
    assert run_on_ranks(_read_and_report, 2, [tmp_path, tmp_path]) == ["600 tokens"] * 2
