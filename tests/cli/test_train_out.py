"""A fresh ``d9d train`` into the ``--out`` of another run is refused before it writes anything
(issue 23, item 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from d9d.cli import main


def _args(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--out",
        str(out),
        *extra,
    ]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_fresh_run_into_a_finished_run_is_refused_and_touches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(_args(out, "--save-every", "1")) == 0
    before = _files(out)
    assert {"config.json", "metrics.jsonl", "checkpoints/step_2/COMMIT"} <= set(before)
    capsys.readouterr()
    assert main(_args(out, "--steps", "3", "--save-every", "1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"d9d train: error: --out '{out}' already holds a run (config.json, metrics.jsonl, "
        "checkpoints/); pass --resume to continue it, or a new --out to start another "
        "(nothing was written)"
    ]
    assert _files(out) == before


def test_any_trace_of_a_run_is_enough_and_an_empty_folder_is_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "checkpoints" / "step_4.tmp-0dead000").mkdir(parents=True)  # a killed first save
    assert main(_args(tmp_path, "--steps", "1")) == 2
    assert "already holds a run (checkpoints/)" in capsys.readouterr().err
    (tmp_path / "checkpoints" / "step_4.tmp-0dead000").rmdir()
    assert main(_args(tmp_path, "--steps", "1")) == 0
