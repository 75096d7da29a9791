"""``d9d.init_process_group`` outside torchrun (the restart behaviour is tested under a real
torchrun in tests/cli/test_train_restarts.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

import d9d


def test_outside_torchrun_it_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match=r"RANK is not set: launch with `torchrun"):
        d9d.init_process_group()


def test_a_restarted_attempt_does_not_see_the_dead_attempts_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun's agent store outlives an attempt; what one attempt's group wrote there is
    invisible to the next (and visible to the same attempt number, so the scoping is by
    attempt, not by chance)."""
    agent = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    env = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(agent.port),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def sees_key_after_joining(attempt: str) -> bool:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        d9d.init_process_group(timeout=timedelta(seconds=30))
        try:
            store = dist.distributed_c10d._get_default_store()
            seen = store.check(["left by attempt 0"])
            store.set("left by attempt 0", "x")
            dist.barrier()
            return seen
        finally:
            dist.destroy_process_group()

    assert not sees_key_after_joining("0")
    assert not sees_key_after_joining("1")
    assert sees_key_after_joining("0")
