"""``d9d train --resume``: a run stopped after a checkpoint continues with identical losses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from d9d import checkpoint
from d9d.cli import main
from d9d.cli.train import _run as _train


def _args(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--steps",
        "10",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--out",
        str(out),
        *extra,
    ]


def _losses(out: Path) -> list[tuple[int, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


class _Crash(Exception):
    pass


def _crash_at_call(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    make_step = _train.make_train_step

    def crashing(*args: Any, **kwargs: Any) -> Any:
        step, calls = make_step(*args, **kwargs), []

        def wrapped(*step_args: Any) -> Any:
            calls.append(1)
            if len(calls) == n:
                raise _Crash
            return step(*step_args)

        return wrapped

    monkeypatch.setattr(_train, "make_train_step", crashing)


def test_resume_gives_the_losses_of_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main([*_args(tmp_path / "straight"), "--resume"]) == 0  # nothing to resume: fresh
    with monkeypatch.context() as patch:
        _crash_at_call(7, patch)
        with pytest.raises(_Crash):
            main([*_args(tmp_path / "stopped"), "--save-every", "5"])
    checkpoints = tmp_path / "stopped" / "checkpoints"
    assert checkpoint.latest(checkpoints) == checkpoints / "step_5"
    assert [s for s, _ in _losses(tmp_path / "stopped")] == [1, 2, 3, 4, 5, 6]
    assert main([*_args(tmp_path / "stopped"), "--save-every", "5", "--keep", "1", "--resume"]) == 0
    assert _losses(tmp_path / "stopped") == _losses(tmp_path / "straight")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_10"]
    assert main([*_args(tmp_path / "stopped"), "--resume"]) == 0  # done: nothing to run


def test_bad_checkpoint_flags_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*_args(tmp_path), "--keep", "0"]) == 2
    assert "--save-every must be >= 0 and --keep >= 1, got 0 and 0" in capsys.readouterr().err
    # It lets a resumed run change its schedule; a fresh run has none to change.
    assert main([*_args(tmp_path), "--allow-config-change"]) == 2
    assert capsys.readouterr().err == (
        "d9d train: error: --allow-config-change only applies with --resume or --resume-from "
        "(it lets a resumed run change a flag that changes the schedule or the model); add "
        "one, or drop it\n"
    )
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # refused before writing


@pytest.mark.parametrize("seconds", ["0", "-5", "inf"])
def test_a_dist_timeout_that_is_not_a_positive_number_is_refused(
    seconds: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0 timed every store connection out under torchrun, with torch's stack dump."""
    assert main([*_args(tmp_path), "--dist-timeout", seconds]) == 2
    assert capsys.readouterr().err == (
        f"d9d train: error: --dist-timeout must be a positive number of seconds, got "
        f"{float(seconds)}\n"
    )
