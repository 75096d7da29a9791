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
from ft_groups import kill_and_restart, start_group, steps_logged
from ft_groups import lighthouse as ft_lighthouse

from d9d.cli import main
from d9d.cli._config import TrainConfig
from d9d.cli.train._checks import check_flags
from d9d.errors import ConfigError

ARGS = ["train", "--steps", "3", "--batch-size", "4", "--seq-len", "32", "--no-tensorboard"]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").open()]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("layout", "batch"),
    [
        ("--fsdp=2", 4),
        ("--tp=2", 4),
        ("--fsdp=2 --grad-accum=2", 8),
        ("--pp=2 --microbatches=2", 4),
    ],
    ids=["fsdp2", "tp2", "fsdp2_grad_accum2", "pp2"],
)
def test_two_replica_groups_train_as_one_process(tmp_path: Path, layout: str, batch: int) -> None:
    """Each group a torchrun of two ranks, sharded (fsdp=2), tensor-parallel (tp=2) or
    pipelined (pp=2, its stages' grads all-reduced over the groups after the schedule) inside;
    with --grad-accum 2 (a row per microbatch and rank), the all-reduce over the groups runs
    once after both microbatches."""
    pytest.importorskip("torchft.coordination")
    args = [*ARGS, f"--batch-size={batch}"]  # the last --batch-size counts
    assert main([*args, "--log-every", "1", "--out", str(tmp_path / "one")]) == 0
    # min_replicas=1, as a run that survives a failure needs: the groups wait for each other
    # before their first step themselves.
    lighthouse = ft_lighthouse()
    logs = [tmp_path / f"group{g}.log" for g in (0, 1)]
    groups: list[subprocess.Popen] = []
    try:
        # Into files, not pipes: a pipe nobody reads while the test waits for the other group
        # fills with torchft's log lines and stops its writer, and so both groups.
        groups = [
            subprocess.Popen(
                [
                    *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
                    *("--nproc-per-node=2", "-m", "d9d", *args, "--log-every=1", *layout.split()),
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
        ({"lighthouse": "x"}, ValueError, r"--lighthouse only applies with --fault-tolerant"),
        ({**FT, "replica_group_id": 2}, ValueError, r"--replica-group-id must be in 0 \.\."),
        ({**FT, "replica_group_id": 0, "jit": True}, ConfigError, r"not run with --jit yet"),
        (
            {**FT, "replica_group_id": 0, "model": "moe"},
            ConfigError,
            r"--fault-tolerant does not run with --model moe yet: its expert loads are summed",
        ),
        (
            {**FT, "replica_group_id": 1, "pp": 2, "diloco": 1},
            ConfigError,
            r"--diloco does not run with --pp yet: no test has run a DiLoCo outer round over",
        ),
        (
            {**FT, "replica_group_id": 1, "diloco": 2, "save_every": 5},
            ConfigError,
            r"--save-every 5 is not a multiple of --diloco 2: a DiLoCo group saves right after",
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


TORCHRUN_FSDP2 = [
    *("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "d9d"),
    "--fsdp=2",
]


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("launch", "saving"),
    [(["-m", "d9d"], False), (TORCHRUN_FSDP2, False), (["-m", "d9d"], True)],
    ids=["one_rank", "fsdp2", "one_rank_checkpoints"],
)
def test_a_killed_replica_group_restarts_and_rejoins(
    tmp_path: Path, launch: list[str], saving: bool
) -> None:
    # The lighthouse forms no quorum of fewer than both groups (min_replicas=2): the survivor
    # never commits a step alone (its step whose peer was killed fails its vote, and its next
    # quorum waits for the restarted group), so every step of both groups has the losses of
    # one process fed the whole batch: the restarted group must have taken the survivor's
    # params, optimizer state and data position (each rank its own shard under fsdp=2) to
    # give them. (Freezing the survivor instead did not stop the lighthouse from answering a
    # quorum request it had already sent, alone, once the killed group's heartbeat timed out:
    # seen in CI.) With checkpoints (--save-every 2 --resume), the restarted group restores
    # its step 2 first, and must still take the survivor's state, which is ahead of it.
    pytest.importorskip("torchft.coordination")
    steps = 8
    args = [*ARGS[:2], str(steps), *ARGS[3:], "--log-every", "1"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    if saving:
        args += ["--save-every", "2", "--resume"]
    lighthouse = ft_lighthouse(min_replicas=2, heartbeat_timeout_ms=2_000)
    outs = [tmp_path / f"group{g}" for g in (0, 1)]
    runner, layout = launch[: launch.index("d9d") + 1], launch[launch.index("d9d") + 1 :]

    def start(group: int, log: str) -> subprocess.Popen:
        command = [sys.executable, *runner, *args, *layout]
        return start_group(command, lighthouse, group, outs[group], tmp_path / log)

    # With checkpoints: step 2's committed once step 3 vouched for it, the survivor past it.
    second = outs[1] / "checkpoints" / "step_2" / "COMMIT"
    ready = second.exists if saving else lambda: 2 in steps_logged(outs[1])
    codes = kill_and_restart(start, lighthouse, "step 2", ready)
    for code, log in zip(codes, ("group0.log", "group1b.log"), strict=True):
        assert code == 0, (tmp_path / log).read_text()[-3000:]
    restarted = (tmp_path / "group1b.log").read_text()
    assert "rejoined at step" in restarted
    assert ("step_2' at step 3" in restarted) == saving  # resumed from its own checkpoint
    assert steps_logged(outs[0]) == list(range(1, steps + 1))  # consecutive, none repeated
    # The killed run's records, then the restarted run's from the step after it rejoined.
    logged = steps_logged(outs[1])
    assert logged == sorted(set(logged)) and logged[-1] == steps and 2 in logged
    want = dict(enumerate(_losses(tmp_path / "one"), start=1))
    for out in outs:
        for line in (out / "metrics.jsonl").open():
            record = json.loads(line)
            assert record["loss"] == pytest.approx(want[record["step"]], rel=1e-5)


def test_a_replica_group_continues_only_in_its_own_out(tmp_path: Path) -> None:
    from d9d.cli.train._out import check_fresh_out

    (tmp_path / "config.json").write_text(
        json.dumps({"fault_tolerant": True, "replica_group_id": 1})
    )
    check_fresh_out(tmp_path, resuming=False, replica_group=1)  # its run before a restart
    with pytest.raises(ConfigError, match=r"already holds a run \(config\.json\)"):
        check_fresh_out(tmp_path, resuming=False, replica_group=0)  # another group's
    with pytest.raises(ConfigError, match=r"already holds a run"):
        check_fresh_out(tmp_path, resuming=False)  # a run without --fault-tolerant
