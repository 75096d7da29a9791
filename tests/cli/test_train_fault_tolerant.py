"""``d9d train --fault-tolerant``: two replica groups (a ``torchrun`` of two fsdp ranks each)
on a torchft lighthouse in this process give the losses of one process fed the whole batch;
its flags are checked and what it does not run with is refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from d9d.cli import main
from d9d.cli._config import TrainConfig
from d9d.cli.train._checks import check_flags
from d9d.errors import ConfigError

ARGS = ["train", "--steps", "3", "--batch-size", "4", "--seq-len", "32", "--no-tensorboard"]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").open()]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_replica_groups_train_as_one_process(tmp_path: Path) -> None:
    torchft = pytest.importorskip("torchft.coordination")
    assert main([*ARGS, "--log-every", "1", "--out", str(tmp_path / "one")]) == 0
    # min_replicas=1, as a run that survives a failure needs: the groups wait for each other
    # before their first step themselves.
    lighthouse = torchft.LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=60_000, quorum_tick_ms=50
    )
    logs = [tmp_path / f"group{g}.log" for g in (0, 1)]
    groups: list[subprocess.Popen] = []
    try:
        # Into files, not pipes: a pipe nobody reads while the test waits for the other group
        # fills with torchft's log lines and stops its writer, and so both groups.
        groups = [
            subprocess.Popen(
                [
                    *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
                    *("--nproc-per-node=2", "-m", "d9d", *ARGS, "--log-every=1", "--fsdp=2"),
                    *("--fault-tolerant", f"--lighthouse={lighthouse.address()}"),
                    *(f"--replica-group-id={g}", "--replica-groups=2"),
                    f"--out={tmp_path / f'group{g}'}",
                ],
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
            )
            for g, log in enumerate(logs)
        ]
        codes = [group.wait(timeout=240) for group in groups]
    finally:
        for group in groups:
            if group.poll() is None:
                group.kill()
        lighthouse.shutdown()
    for code, log in zip(codes, logs, strict=True):
        assert code == 0, log.read_text()[-3000:]
    want = _losses(tmp_path / "one")
    for g in (0, 1):
        assert _losses(tmp_path / f"group{g}") == pytest.approx(want, rel=1e-5)


FT = {"fault_tolerant": True, "lighthouse": "http://localhost:1", "replica_groups": 2}


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"fault_tolerant": True}, ValueError, r"--fault-tolerant needs --lighthouse, --replica"),
        ({"lighthouse": "x"}, ValueError, r"--lighthouse only apply with --fault-tolerant"),
        ({**FT, "replica_group_id": 2}, ValueError, r"--replica-group-id must be in 0 \.\."),
        ({**FT, "replica_group_id": 0, "jit": True}, ConfigError, r"not run with --jit yet"),
        (
            {**FT, "replica_group_id": 1, "save_every": 5},
            ConfigError,
            r"takes its state from a live peer",
        ),
    ],
)
def test_fault_tolerant_flags_are_checked(fields: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        check_flags(TrainConfig(**fields))


def test_each_replica_group_reads_its_own_rows() -> None:
    # Equal losses cannot show it: every group reading the whole batch averages to the same.
    from d9d.cli.train._run import _data_rank

    class InGroup:  # a group of 2 data-parallel ranks; this is its second
        def data_rank(self) -> tuple[int, int]:
            return 1, 2

    config = TrainConfig(**FT, replica_group_id=1)
    assert _data_rank(InGroup(), object(), config) == (3, 4)
    assert _data_rank(InGroup(), None, config) == (1, 2)
