from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from d9d.cli import main


def _tiny_args(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--steps",
        "4",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--out",
        str(out),
        *extra,
    ]


def test_train_writes_metrics_plot_and_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_tiny_args(tmp_path / "run", "--log-every", "2")) == 0
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [2, 4]
    assert set(records[0]) == {
        "step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "elapsed_s",
        "peak_rss_gib",
    }  # fmt: skip
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "run" / "config.json").read_text())["steps"] == 4
    # The summary's first loss is step 2's, the first one logged, and says so.
    first, last = records[0]["loss"], records[-1]["loss"]
    assert f"loss {first:.3f} (step 2) -> {last:.3f} in 4 steps (1-4)" in capsys.readouterr().out


def test_train_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    assert main(_tiny_args(tmp_path / "a", "--seed", "3")) == 0
    assert main(_tiny_args(tmp_path / "b", "--seed", "3")) == 0

    def losses(run: str) -> list[float]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]

    assert losses("a") == losses("b")


def test_train_reads_a_text_folder(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello d9d " * 200)
    assert main(_tiny_args(tmp_path / "run", "--data", str(corpus))) == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--data", "/no/such/path"], r"--data '/no/such/path' does not exist"),
        (["--steps", "0"], r"--steps must be >= 1, got 0"),
        (["--clip", "0"], r"--clip must be a positive number .*, got 0\.0; clipping cannot"),
        (["--clip", "nan"], r"--clip must be a positive number .*, got nan"),
        (["--weight-decay", "-0.1"], r"--weight-decay must be a number >= 0, got -0\.1"),
        (["--preset", "huge"], r"huge"),
        (["--seq-len", "4096"], r"--seq-len 4096 exceeds the 'tiny' preset's max_seq_len 256"),
        (["--vocab-size", "100"], r"token id \d+ but the model's vocab_size is 100"),
    ],
)
def test_bad_input_is_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main([*_tiny_args(tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("d9d train: error:")
    assert re.search(message, err)


def test_empty_data_folder_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert main([*_tiny_args(tmp_path / "run"), "--data", str(tmp_path / "empty")]) == 2
    assert "empty" in capsys.readouterr().err


def test_module_entry_point_reports_bad_flags_without_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "d9d", "train", "--steps", "many"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "d9d train: error: argument --steps: invalid int value: 'many' (see --help)"
    ]


def test_plan_command_prints_the_table_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "1b", "--dp", "2", "--fsdp", "4", "--rows", "6"]) == 0
    out = capsys.readouterr().out
    assert "on 8 simulated ranks: dp=2 x fsdp=4" in out
    assert "fsdp:S(0)" in out and "memory on rank 0 (AdamW" in out and "146 params" in out
    assert main(["plan", "--fsdp", "0"]) == 2
    assert "--fsdp must be an int >= 1, got 0" in capsys.readouterr().err
