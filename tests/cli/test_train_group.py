"""Under torchrun's shared store, each restart attempt's process-group keys get their own prefix."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from d9d import _train_group


@pytest.mark.parametrize("attempt", ["0", "1"])
def test_each_torchrun_attempt_has_its_own_store_prefix(
    monkeypatch: pytest.MonkeyPatch, attempt: str
) -> None:
    agent = dist.TCPStore(
        "127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    agent.set("default_pg/0/stale", "a dead attempt's key")  # what the old attempt left
    env = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": attempt,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(agent.port),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _train_group._attempt_store().set("mine", "this attempt's key")
    assert agent.check([f"d9d/attempt_{attempt}/mine"])
    _train_group.init_process_group()
    try:
        store = dist.distributed_c10d._get_default_store()
        assert not store.check(["default_pg/0/stale"]) and not store.check(["0/stale"])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_without_the_shared_store_the_group_is_torchs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert _train_group._attempt_store() is None
