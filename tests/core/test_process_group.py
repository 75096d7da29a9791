"""``d9d.init_process_group`` outside torchrun (the restart behaviour is tested under a real
torchrun in tests/cli/test_train_restarts.py)."""

from __future__ import annotations

import pytest

import d9d


def test_outside_torchrun_it_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match=r"RANK is not set: launch with `torchrun"):
        d9d.init_process_group()
