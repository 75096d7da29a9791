"""``d9d train --fault-tolerant --save-every N --resume``: two replica groups (one process each)
on a torchft lighthouse in this process save their own checkpoints, are all killed at once
(a power cut), and resume: the group whose newest saves were lost heals from the one ahead,
and every loss and eval loss both log equals one process fed the whole batch. A group saves
committed steps only (the loop with a scripted vote), and its own ``--out`` with checkpoints
needs ``--resume``."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ft_groups import lighthouse as ft_lighthouse
from ft_groups import signal_all, start_group, steps_logged, wait_for

from d9d.cli import main
from d9d.cli.train._out import check_fresh_out
from d9d.errors import ConfigError

STEPS = 12  # the kill comes after step 3: the groups must not have finished by then
ARGS = [
    *("train", "--steps", str(STEPS), "--batch-size", "4", "--seq-len", "32"),
    *("--no-tensorboard", "--log-every", "1", "--eval-every", "2", "--eval-batches", "1"),
]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


def _committed(out: Path, step: int) -> bool:
    return (out / "checkpoints" / f"step_{step}" / "COMMIT").exists()


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_replica_groups_resume_from_their_checkpoints(tmp_path: Path) -> None:
    pytest.importorskip("torchft.coordination")
    assert main([*ARGS, "--out", str(tmp_path / "one")]) == 0
    lighthouse = ft_lighthouse(heartbeat_timeout_ms=2_000)
    outs = [tmp_path / f"group{g}" for g in (0, 1)]

    def start(group: int, log: str) -> subprocess.Popen:
        # --resume from the first start: with no checkpoint yet, a group starts at step 1.
        command = [sys.executable, "-m", "d9d", *ARGS, "--save-every", "2", "--resume"]
        return start_group(command, lighthouse, group, outs[group], tmp_path / log)

    procs: list[subprocess.Popen] = []
    try:
        procs = [start(0, "group0.log"), start(1, "group1.log")]
        # Committed once step 3 vouched for it, on both groups.
        wait_for("step 2's checkpoints", lambda: all(_committed(o, 2) for o in outs), procs)
        # Both frozen before either dies: neither commits a step alone.
        for proc in procs:
            signal_all(proc, signal.SIGSTOP)
        for proc in procs:
            signal_all(proc, signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
        ahead = max(n for n in range(2, STEPS, 2) if _committed(outs[0], n))
        # The power cut lost group 1's saves from group 0's newest on: it resumes behind.
        for n in range(ahead, STEPS, 2):
            shutil.rmtree(outs[1] / "checkpoints" / f"step_{n}", ignore_errors=True)
        procs = [start(0, "group0b.log"), start(1, "group1b.log")]
        codes = [proc.wait(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                signal_all(proc, signal.SIGCONT)
                signal_all(proc, signal.SIGKILL)
        lighthouse.shutdown()
    for code, log in zip(codes, ("group0b.log", "group1b.log"), strict=True):
        assert code == 0, (tmp_path / log).read_text()[-3000:]
    behind = (tmp_path / "group1b.log").read_text()
    restored = f"step_{ahead - 2}' at step {ahead - 1}" if ahead > 2 else "no checkpoint in"
    assert restored in behind  # restored its own newest checkpoint (or none)...
    assert f"rejoined at step {ahead}" in behind  # ...then took group 0's, further ahead
    assert f"step_{ahead}' at step {ahead + 1}" in (tmp_path / "group0b.log").read_text()
    want = {r["step"]: r for r in _records(tmp_path / "one")}
    for out in outs:
        assert steps_logged(out) == list(range(1, STEPS + 1))  # consecutive, none repeated
        for record in _records(out):
            step = record["step"]
            assert record["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), (out, step)
            if step % 2 == 0:  # each group evaluates its own params: equal on both
                assert record["eval_loss"] == pytest.approx(want[step]["eval_loss"], rel=1e-5)


def test_a_replica_groups_checkpoints_need_resume(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"fault_tolerant": True, "replica_group_id": 1})
    )
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"group 1's run with checkpoints; pass --resume"):
        check_fresh_out(tmp_path, resuming=False, replica_group=1)
    check_fresh_out(tmp_path, resuming=True, replica_group=1)


class _Group:
    """A replica group as ``d9d train``'s loop sees it, its commit votes scripted: the step
    below commits (advancing the count) or not, call by call."""

    diloco = None

    def __init__(self, votes: list[bool]) -> None:
        self.votes, self.step, self.position, self.manager = list(votes), 0, None, self

    def start_step(self) -> bool:
        return False

    def commits(self) -> int:
        return self.step

    def join(self, params: object, opt_state: object) -> tuple[object, object]:
        return params, opt_state

    def steps_done(self, opt_state: object) -> int:
        return self.step

    def state_dict(self) -> dict[str, int]:  # the manager's
        return {"step": self.step, "batches_committed": self.step}


class _Saver:
    """Records what the loop saves (every step is due)."""

    every, held, directory = 1, None, Path("unused")

    def __init__(self) -> None:
        self.saved: list[tuple[int, float, dict]] = []

    def due(self, step: int) -> bool:
        return True

    def save(self, step, params, opt_state, loader, metadata=None) -> None:
        self.saved.append((step, float(params["w"]), metadata))

    def vouch(self) -> None:
        pass

    def wait(self) -> None:
        pass


class _Loader:
    def __init__(self) -> None:
        self.read = 0

    def __next__(self) -> dict:
        self.read += 1
        return {"tokens": torch.zeros(1, 2, dtype=torch.long)}

    def state_dict(self) -> dict[str, int]:
        return {"read": self.read}


def test_a_replica_group_saves_committed_steps_only(tmp_path: Path) -> None:
    from rich.console import Console

    from d9d import optim
    from d9d.cli._config import TrainConfig
    from d9d.cli.train._log import MetricsLog
    from d9d.cli.train._metrics import SpeedMeter
    from d9d.cli.train._preempt import Preemption
    from d9d.cli.train._profile import StepProfiler
    from d9d.cli.train._progress import TrainProgress
    from d9d.cli.train._run import _loop, _Watch
    from d9d.cli.train._watch import Dashboards

    group = _Group([True, False, True, False, False, True])  # steps 2 and 3 run again
    one = torch.ones(())

    def step(params, opt_state, batch):
        metrics = {"loss": one, "grad_norm": one}
        if not group.votes.pop(0):
            return params, opt_state, metrics  # dropped: the inputs come back
        group.step += 1
        return {"w": params["w"] + 1}, opt_state, metrics

    config = TrainConfig(steps=3, save_every=1, log_every=100, out=tmp_path, tensorboard=False)
    saver, cpu = _Saver(), torch.device("cpu")
    opt_state = optim.adamw(1e-3).init({"w": torch.zeros(())})
    with Preemption() as preemption:
        watch = _Watch(
            MetricsLog(None, None),
            Dashboards(config, {}, None, False),
            TrainProgress(Console(quiet=True), 3, 0, show=False),
            SpeedMeter(1, 1, cpu, 1),
            None,
            StepProfiler(tmp_path / "trace.json", 0, 0),
            preemption,
            group,
        )
        _loop(config, step, {"w": torch.zeros(())}, opt_state, _Loader(), cpu, 0, saver, watch)
    assert group.votes == []
    # Each committed step once, with its own params and the manager's count; none dropped.
    assert [(n, w) for n, w, _ in saver.saved] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert [m["torchft"]["step"] for _, _, m in saver.saved] == [1, 2, 3]
