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


def test_a_second_run_while_one_writes_is_refused_and_the_lock_goes_with_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two runs at once in one --out both found it empty and wrote into it: one run's
    config.json and records beside the other's checkpoints. Rank 0 locks the folder."""
    from d9d.cli.train import _run

    out, answers = tmp_path / "run", []
    make_step = _run.make_train_step

    def second_run_in_step_2(*args: object, **kwargs: object) -> object:
        step, calls = make_step(*args, **kwargs), []

        def wrapped(*step_args: object) -> object:
            calls.append(1)
            if len(calls) == 2:  # the first run has written config.json and a record
                answers.append(main(_args(out, "--lr", "1e-2")))
                answers.append(main(_args(out, "--resume")))
            return step(*step_args)

        return wrapped

    with monkeypatch.context() as patch:
        patch.setattr(_run, "make_train_step", second_run_in_step_2)
        assert main(_args(out, "--save-every", "1")) == 0
    assert answers == [2, 2]
    err = capsys.readouterr().err.splitlines()
    refused = (
        f"d9d train: error: --out '{out}' is in use by another d9d train run, which holds its "
        "lock until it ends (its last checkpoint committed); wait for it, or pass a new --out "
        "(nothing was written)"
    )
    assert err.count(refused) == 2
    assert '"lr": 0.003' in (out / "config.json").read_text()
    assert [line[:10] for line in (out / "metrics.jsonl").read_text().splitlines()] == [
        '{"step": 1',
        '{"step": 2',
    ]
    assert main(_args(out, "--resume")) == 0  # the lock left with the run


@pytest.mark.parametrize("under", ["", "run"], ids=["a-file", "inside-a-file"])
def test_an_out_that_a_file_blocks_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], under: str
) -> None:
    """It failed with a bare ``[Errno 17] File exists`` (exit 1) once the model was built."""
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / under if under else tmp_path / "file"
    assert main(_args(out)) == 2
    assert capsys.readouterr().err.strip() == (
        f"d9d train: error: --out '{out}' cannot be a folder: '{tmp_path / 'file'}' is a file; "
        "pass another --out"
    )
