"""``d9d train --fault-tolerant --diloco H``: two replica groups (one process each) on a torchft
lighthouse in this process train apart between outer rounds; its flags are checked."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ft_groups import kill_and_restart, signal_all, start_group, steps_logged, wait_for
from ft_groups import lighthouse as ft_lighthouse

from d9d.cli import main
from d9d.cli._config import TrainConfig
from d9d.cli.train._checks import check_flags
from d9d.cli.train._replica_group import ReplicaGroup
from d9d.transforms.diloco._transform import MANAGER_METHODS

ARGS = [
    *("train", "--steps", "3", "--batch-size", "4", "--seq-len", "32", "--no-tensorboard"),
    *("--eval-every", "2", "--eval-batches", "1", "--grad-accum", "2"),
]


# `d9d` with --jit compiling on eager kernels (aot_eager), as inductor's first compile costs
# about 20 s here: the flag's path through `d9d train` is the same. It prints how many graphs
# the jitted step traced.
JITTED = (
    sys.executable,
    "-c",
    "\n".join(
        [
            "import sys, d9d, d9d.cli.train._run as run",
            "jitted = []",
            "run._jit = lambda step: jitted.append(d9d.jit(step, backend='aot_eager')) or jitted[0]",
            "from d9d.cli import main",
            "code = main(sys.argv[1:])",
            "print(f'jitted: {[j.traces for j in jitted]} graphs')",
            "sys.exit(code)",
        ]
    ),
)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in _records(out)]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_diloco_groups_each_train_on_their_own_rows_one_of_them_jitted(
    tmp_path: Path,
) -> None:
    """Group 1 runs with --jit: its inner steps compiled, its outer rounds with group 0's,
    after a warm-up round (--diloco-warmup 2: rounds after steps 1, 2 and 4)."""
    pytest.importorskip("torchft.coordination")
    assert main([*ARGS, "--log-every", "1", "--out", str(tmp_path / "one")]) == 0
    lighthouse = ft_lighthouse()
    logs = [tmp_path / f"group{g}.log" for g in (0, 1)]
    groups: list[subprocess.Popen] = []
    try:
        # Into files, not pipes: a pipe nobody reads fills with torchft's log lines.
        groups = [
            subprocess.Popen(
                [
                    *((sys.executable, "-m", "d9d") if g == 0 else JITTED),
                    *(*ARGS, "--log-every=1"),
                    *("--steps=4", "--fault-tolerant", f"--lighthouse={lighthouse.address()}"),
                    *("--diloco=2", "--diloco-warmup=2", "--eval-every=1"),
                    *(("--jit",) if g == 1 else ()),
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
    assert "jitted: [1] graphs" in logs[1].read_text()  # one graph for every inner step
    one = _losses(tmp_path / "one")
    outs = [tmp_path / f"group{g}" for g in (0, 1)]
    first, second = (_losses(out) for out in outs)
    assert len(first) == len(second) == 4
    # Step 1 runs the same initial params on each group's own rows (no exchange before the
    # round after step 2): different losses, whose mean is the one-process loss of all rows.
    assert first[0] != pytest.approx(second[0], rel=1e-3)
    assert (first[0] + second[0]) / 2 == pytest.approx(one[0], rel=1e-5)
    # Each group evaluates its own params, which a round (the warm-up's after step 1, the
    # outer ones after steps 2 and 4) made the same on both, bit for bit, whether their
    # inner steps were compiled or not; after step 3 (no round) they differ.
    evals = [{r["step"]: r.get("eval_loss") for r in _records(out)} for out in outs]
    assert None not in (evals[0][1], evals[0][2], evals[0][3], evals[0][4])
    assert [evals[0][s] for s in (1, 2, 4)] == [evals[1][s] for s in (1, 2, 4)]
    assert evals[0][3] != evals[1][3]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_killed_diloco_group_restarts_and_rejoins(tmp_path: Path) -> None:
    # Rounds every 2 steps; group 1 is killed once it logged step 3 (inside round 2, or a
    # round or two later: the kill takes a moment; 12 steps, so that it has not finished)
    # and restarted with the same command into its own --out. No quorum forms with fewer
    # than both groups (min_replicas=2): the survivor's next round waits for the restarted
    # group, which heals there with the survivor's state and takes part in it. Both then
    # hold the round's anchor, bitwise: after the last round they evaluate their own params
    # to the same eval loss, bit for bit.
    pytest.importorskip("torchft.coordination")
    lighthouse = ft_lighthouse(min_replicas=2, heartbeat_timeout_ms=2_000)
    outs = [tmp_path / f"group{g}" for g in (0, 1)]

    def start(group: int, log: str) -> subprocess.Popen:
        command = [sys.executable, "-m", "d9d", *ARGS[:2], "12", *ARGS[3:8], "--log-every=1"]
        command += ["--eval-every=6", "--eval-batches=1", "--diloco=2"]
        return start_group(command, lighthouse, group, outs[group], tmp_path / log)

    codes = kill_and_restart(start, lighthouse, "step 3", lambda: 3 in steps_logged(outs[1]))
    for code, log in zip(codes, ("group0.log", "group1b.log"), strict=True):
        assert code == 0, (tmp_path / log).read_text()[-3000:]
    said = (tmp_path / "group1b.log").read_text()
    assert re.search(r"diloco: this replica group rejoined after outer round \d+, at inner", said)
    assert steps_logged(outs[0]) == list(range(1, 13))  # consecutive, none repeated
    logged = steps_logged(outs[1])  # the killed run's, then the restarted run's after its round
    assert logged == sorted(set(logged)) and logged[-1] == 12 and 3 in logged
    evals = [{r["step"]: r.get("eval_loss") for r in _records(out)} for out in outs]
    assert evals[0][12] is not None and evals[0][12] == evals[1][12]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_diloco_groups_cut_off_together_resume_as_if_never_stopped(tmp_path: Path) -> None:
    # Both groups saving every 4 steps (rounds after steps 2, 4, ...) are killed together
    # once each committed its step 4 (12 steps: they must not have finished by then),
    # restarted with the same commands, and resume from their own newest checkpoints
    # (params, inner state, anchor, outer state, inner step, data position): every loss they
    # log equals the uninterrupted run's, bit for bit.
    pytest.importorskip("torchft.coordination")
    lighthouse = ft_lighthouse(min_replicas=2, heartbeat_timeout_ms=2_000)

    def start(run: str, group: int, log: str) -> subprocess.Popen:
        command = [sys.executable, "-m", "d9d", *ARGS[:2], "12", *ARGS[3:8], "--log-every=1"]
        command += ["--diloco=2", "--save-every=4", "--resume"]
        return start_group(command, lighthouse, group, tmp_path / run / str(group), tmp_path / log)

    procs: list[subprocess.Popen] = []
    try:
        procs = [start("whole", g, f"whole{g}.log") for g in (0, 1)]
        codes = [proc.wait(timeout=240) for proc in procs]
        procs = [start("cut", g, f"cut{g}.log") for g in (0, 1)]
        for g in (0, 1):
            commit = tmp_path / "cut" / str(g) / "checkpoints" / "step_4" / "COMMIT"
            wait_for(f"group {g}'s step 4 checkpoint", commit.exists, procs)
        for proc in procs:
            signal_all(proc, signal.SIGKILL)
        assert [proc.wait(timeout=60) for proc in procs] == [-signal.SIGKILL] * 2
        procs = [start("cut", g, f"resumed{g}.log") for g in (0, 1)]
        codes += [proc.wait(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                signal_all(proc, signal.SIGKILL)
        lighthouse.shutdown()
    for code, log in zip(codes, ("whole0", "whole1", "resumed0", "resumed1"), strict=True):
        assert code == 0, (tmp_path / f"{log}.log").read_text()[-3000:]
    for g in (0, 1):
        assert "resumed from" in (tmp_path / f"resumed{g}.log").read_text()
        whole = {r["step"]: r["loss"] for r in _records(tmp_path / "whole" / str(g))}
        cut = {r["step"]: r["loss"] for r in _records(tmp_path / "cut" / str(g))}
        assert sorted(cut) == list(range(1, 13))
        assert cut == whole


FT = {"fault_tolerant": True, "lighthouse": "http://localhost:1", "replica_groups": 2}


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"diloco": 8}, r"--diloco only applies with --fault-tolerant"),
        ({**FT, "replica_group_id": 0, "diloco": 0}, r"--diloco H must be >= 1 inner steps"),
        (
            {**FT, "replica_group_id": 0, "diloco": 8, "steps": 20},
            r"--steps 20 is not a multiple of --diloco 8: the last 4 steps",
        ),
        ({"diloco_warmup": 8}, r"--diloco-warmup only applies with --diloco H"),
        (
            {**FT, "replica_group_id": 0, "diloco": 8, "diloco_warmup": 12},
            r"--diloco-warmup 12 must be >= 0 and a multiple of --diloco 8",
        ),
        (
            {**FT, "replica_group_id": 0, "diloco": 8, "master_weights": True, "dtype": "bfloat16"},
            r"--diloco does not run with --master-weights yet: an outer round replaces",
        ),
    ],
)
def test_diloco_flags_are_checked(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_flags(TrainConfig(**fields))


def test_the_diloco_warmup_flag_reaches_the_diloco_step() -> None:
    config = TrainConfig(**FT, replica_group_id=0, diloco=4, diloco_warmup=8, steps=16)
    check_flags(config)
    manager = SimpleNamespace(**{name: lambda *a, **k: None for name in MANAGER_METHODS})
    group = ReplicaGroup(manager, None, 2, 1.0, config.diloco, 1, config.diloco_warmup)
    step = group.wrap(lambda params, state, batch: (params, state, {}))
    assert (step.inner_steps, step.warmup_steps) == (4, 8)


def test_a_resumed_diloco_group_counts_the_rounds_it_committed_not_its_inner_steps() -> None:
    """torchft heals the groups whose count is behind the quorum's: a group restored at inner
    step 2 (rounds every 2 steps) once counted 2 among live groups that had committed 2
    rounds, healed from none, and hung in their next round's all-reduce (it ran its inner
    steps instead); one counting more than the live groups would have been copied back by
    them. Its manager counts the rounds its checkpoint saved, as the live groups do."""
    counts = {"step": 0, "batches_committed": 0}
    manager = SimpleNamespace(**{name: lambda *a, **k: None for name in MANAGER_METHODS})
    manager.current_step = lambda: counts["step"]
    manager.state_dict = lambda: dict(counts)
    manager.load_state_dict = counts.update
    group = ReplicaGroup(manager, None, 2, 1.0, diloco=2, microbatches=1, diloco_warmup=2)
    step = group.wrap(lambda params, state, batch: (params, state, {}))
    params, state = step.place({"w": torch.zeros(2)}, ())
    # Rounds after steps 1 and 2 (the warm-up), 4 and 6; one of them dropped.
    group.resume_at(6, params, state, {"torchft": {"step": 3, "batches_committed": 5}})
    assert counts == {"step": 3, "batches_committed": 5}
    group.resume_at(6, params, state, None)  # no count saved: every round up to step 6
    assert counts["step"] == 4
