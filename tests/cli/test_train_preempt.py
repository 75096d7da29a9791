"""SIGTERM to ``d9d train`` (Slurm or Kubernetes preemption): the step in flight finishes, its
checkpoint is committed, the run says so and exits 143; a second SIGTERM ends it at once; ranks
stop after the same step; ``--resume`` then gives every loss of an uninterrupted run (issue 23,
item 5)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from d9d import checkpoint
from d9d.cli import main
from d9d.cli.train import _run as _train
from d9d.testing import run_on_ranks


def _args(out: Path, *extra: str) -> list[str]:
    return ["train", "--steps", "6", "--batch-size", "4", "--seq-len", "16", "--out", str(out),
            *extra]  # fmt: skip


def _records(out: Path) -> list[tuple[int, float, float, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in map(json.loads, lines)]


def _sigterm_before_call(patch: pytest.MonkeyPatch, call: int, times: int = 1) -> None:
    """Send this process SIGTERM ``times`` times as the train step is called the ``call``-th
    time: the signal reaches it while that step is in flight."""
    make_step = _train.make_train_step

    def patched(*args: Any, **kwargs: Any) -> Any:
        step, calls = make_step(*args, **kwargs), []

        def wrapped(*step_args: Any) -> Any:
            calls.append(1)
            if len(calls) == call:
                for _ in range(times):
                    os.kill(os.getpid(), signal.SIGTERM)
            return step(*step_args)

        return wrapped

    patch.setattr(_train, "make_train_step", patched)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[tuple]:
    out = tmp_path_factory.mktemp("uninterrupted")
    assert main(_args(out)) == 0
    return _records(out)


@pytest.mark.parametrize(
    ("call", "save_every", "committed"),
    [(3, "0", [3]), (4, "2", [2, 4])],
    ids=["no-save-every", "at-a-save"],
)
def test_sigterm_saves_the_step_in_flight_exits_143_and_resumes_exactly(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    uninterrupted: list[tuple],
    call: int,
    save_every: str,
    committed: list[int],
) -> None:
    handler = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as patch:
        _sigterm_before_call(patch, call)
        assert main(_args(tmp_path, "--save-every", save_every)) == 143
    assert signal.getsignal(signal.SIGTERM) is handler  # given back
    checkpoints = tmp_path / "checkpoints"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"d9d train: SIGTERM: stopped after step {call} of 6 and committed "
        f"'{checkpoints / f'step_{call}'}'; exiting with code 143 (continue with --resume)"
    )
    assert checkpoint.all_checkpoints(checkpoints) == [checkpoints / f"step_{n}" for n in committed]
    assert [r[0] for r in _records(tmp_path)] == list(range(1, call + 1))
    assert main(_args(tmp_path, "--save-every", save_every, "--resume")) == 0
    assert _records(tmp_path) == uninterrupted


def _train_signalled_twice(out: Path) -> None:
    import torch

    torch.set_num_threads(1)  # as torchrun sets it for several ranks on one host
    with pytest.MonkeyPatch.context() as patch:
        _sigterm_before_call(patch, 2, times=2)
        os._exit(main(_args(out)))


def test_a_second_sigterm_ends_the_run_at_once(
    tmp_path: Path, fresh_processes: multiprocessing.context.ForkServerContext
) -> None:
    child = fresh_processes.Process(target=_train_signalled_twice, args=(tmp_path,))
    child.start()
    child.join(300)
    assert child.exitcode == -signal.SIGTERM  # killed in step 2, before finishing it
    assert [r[0] for r in _records(tmp_path)] == [1]
    assert checkpoint.all_checkpoints(tmp_path / "checkpoints") == []


def _rank_run(out: Path, signalled: tuple[int, ...], *extra: str) -> int:
    with pytest.MonkeyPatch.context() as patch:
        if dist.get_rank() in signalled:
            _sigterm_before_call(patch, 3)
        return main(_args(out, "--save-every", "4", *extra))


def _preempt_and_resume(folder: Path) -> dict[str, list[int]]:
    """On each rank: an uninterrupted run; a run stopped by SIGTERM to rank 1 only, and its
    resumed run; a run stopped by SIGTERM to every rank. The exit codes of each."""
    return {
        "uninterrupted": [_rank_run(folder / "uninterrupted", ())],
        "one-rank": [_rank_run(folder / "one-rank", (1,)),
                     _rank_run(folder / "one-rank", (), "--resume")],
        "every-rank": [_rank_run(folder / "every-rank", (0, 1))],
    }  # fmt: skip


@pytest.mark.distributed
def test_ranks_stop_after_the_same_step_and_resume_exactly(tmp_path: Path) -> None:
    """Spawned ranks: tensorstore, which writes the checkpoints, does not survive a fork."""
    for codes in run_on_ranks(_preempt_and_resume, 2, tmp_path, method="spawn", timeout=600):
        assert codes == {"uninterrupted": [0], "one-rank": [143, 0], "every-rank": [143]}
    uninterrupted = _records(tmp_path / "uninterrupted")
    for name in ("one-rank", "every-rank"):
        checkpoints = tmp_path / name / "checkpoints"
        assert (checkpoints / "step_3").is_dir()  # where both ranks stopped, committed
        assert checkpoint.metadata(checkpoints / "step_3")["world_size"] == 2
    assert _records(tmp_path / "every-rank") == uninterrupted[:3]
    assert _records(tmp_path / "one-rank") == uninterrupted
