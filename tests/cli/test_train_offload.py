"""``d9d train --offload-opt-state`` and ``d9d plan --offload-opt-state``: AdamW's state on
the host (``shard_params(opt_state_device="cpu")`` with ``d9d.optim.offloaded``)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from d9d.cli._config import TrainConfig
from d9d.cli.plan._report import human
from d9d.cli.plan._show import show_plan
from d9d.cli.train._run import train
from d9d.models import LlamaConfig
from d9d.testing import run_on_ranks

_RUN = {"steps": 3, "batch_size": 4, "seq_len": 32}


@pytest.fixture(autouse=True)
def _fresh_sharding_cache() -> Iterator[None]:
    """One-process runs place DTensors on a one-rank world of their own: DTensor's sharding
    cache, keyed by mesh layout, is cleared after them (see ``d9d.testing.fake_world``)."""
    yield
    _clear_sharding_prop_cache()


def _losses(out: Path, **flags: Any) -> list[float]:
    config = TrainConfig(out=out, **{**_RUN, **flags})
    return [r["loss"] for r in train(config, console=Console(file=io.StringIO())).records]


def _both(out: Path, flags: dict[str, Any]) -> tuple[list[float], list[float]]:
    return _losses(out / "device", **flags), _losses(out / "host", offload_opt_state=True, **flags)


@pytest.mark.distributed
@pytest.mark.parametrize("zero", [3, 1])
def test_train_with_the_state_on_the_host_equals_the_run_without(zero: int, tmp_path: Path) -> None:
    """fsdp=2, 3 steps: the same losses to the bit. (No checkpoint here: a forked child that
    writes one aborts once its parent has used tensorstore; tests/distributed/test_host_state.py
    saves and restores the host state on thread ranks.)"""
    ranks = run_on_ranks(_both, 2, tmp_path, {"fsdp": 2, "zero": zero}, method="fork", timeout=300)
    for device, host in ranks:
        assert host == device and len(host) == 3


@pytest.mark.distributed
def test_pipeline_train_with_the_state_on_the_host_equals_the_run_without(tmp_path: Path) -> None:
    """--pp 2 --fsdp 2 --microbatches 2, 3 steps: each stage's state on the host gives the
    losses of the run with it on the device, to the bit, on every rank."""
    flags = {"pp": 2, "fsdp": 2, "microbatches": 2}
    for device, host in run_on_ranks(_both, 4, tmp_path, flags, method="fork", timeout=300):
        assert host == device and len(host) == 3


def _memory(lines: list[str]) -> dict[str, list[str]]:
    """The memory lines' figures by their first word (``host`` for ``host state``)."""
    rows = (line.split() for line in lines if line.startswith("  "))
    return {row[0]: row[2:4] if row[0] == "host" else row[1:3] for row in rows}


def test_plan_shows_the_host_state_apart() -> None:
    """fsdp=2, tiny Llama (n params, float32): AdamW's 8 bytes a param over two ranks, and its
    counters (8 + 8 + 4 bytes), in host memory; none on the device."""
    n = LlamaConfig.tiny().num_params
    for zero in (3, 1):
        plain = show_plan("tiny", fsdp=2, seq=64, max_rows=2, zero=zero).splitlines()
        lines = show_plan(
            "tiny", fsdp=2, seq=64, max_rows=2, zero=zero, offload_opt_state=True
        ).splitlines()
        value, before = _memory(lines), _memory(plain)
        assert value["host"] == human(8 * n // 2 + 20).split()
        assert value["optimizer"] == ["0", "B"] and "host" not in before
        assert before["optimizer"] == human(8 * n // 2 + 20).split()
        assert (value["params"], value["grads"]) == (before["params"], before["grads"])


def test_plan_of_a_pipeline_shows_its_stage_state_on_the_host() -> None:
    """pp=2 x fsdp=2, --zero 2: rank 0's stage (the embedding and layers.0, as in
    tests/cli/test_plan_command.py) keeps AdamW's 8 bytes a param over fsdp and the counters
    on the host, none on the device; params and grads as without the flag."""
    stage = 256 * 64 + 2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 176 * 64
    plain = show_plan("tiny", pp=2, fsdp=2, zero=2, seq=64, max_rows=0).splitlines()
    lines = show_plan(
        "tiny", pp=2, fsdp=2, zero=2, seq=64, max_rows=0, offload_opt_state=True
    ).splitlines()
    value, before = _memory(lines), _memory(plain)
    assert value["host"] == before["optimizer"] == human(8 * stage // 2 + 20).split()
    assert value["optimizer"] == ["0", "B"]
    assert (value["params"], value["grads"]) == (before["params"], before["grads"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"fsdp": 2, "master_weights": True}, r"does not combine with --master-weights yet"),
    ],
)
def test_plan_refusals(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        show_plan("tiny", seq=64, offload_opt_state=True, **flags)


def test_one_process_with_the_state_on_the_host_equals_the_run_without(tmp_path: Path) -> None:
    """One process: shard_params over a one-rank group, as --dtype bfloat16 takes it."""
    device, host = _both(tmp_path, {})
    assert host == device and len(host) == 3


def test_train_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--offload-opt-state does not combine with --jit yet"):
        _losses(tmp_path, offload_opt_state=True, jit=True)
    with pytest.raises(ValueError, match=r"does not combine with --master-weights yet"):
        _losses(tmp_path, offload_opt_state=True, master_weights=True, dtype="bfloat16")
