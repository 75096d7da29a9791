"""What ``d9d train`` records for watching a run: TensorBoard, W&B, plain progress lines off a
terminal, held-out evaluation and a profiler trace."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from d9d.cli import main


def _args(out: Path, *extra: str, steps: int = 4) -> list[str]:
    return ["train", "--steps", str(steps), "--batch-size", "2", "--seq-len", "16",
            "--out", str(out), *extra]  # fmt: skip


def _records(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_holds_the_logged_losses(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(_args(tmp_path / "run", "--log-every", "2")) == 0
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    logged = _records(tmp_path / "run")
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in logged
    ]
    assert {"lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_rss_gib"} <= set(
        events.Tags()["scalars"]
    )


def test_tensorboard_of_a_resumed_run_holds_each_step_once(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert main(_args(run, "--save-every", "2")) == 0
    shutil.rmtree(run / "checkpoints" / "step_4")
    # The first run's file, named as if opened a second from now by a host that sorts last:
    # the resumed file must still be read after it, or its purge hides nothing.
    (first,) = (run / "tensorboard").glob("*tfevents*")
    first.rename(first.with_name(f"events.out.tfevents.{int(time.time()) + 1:010d}.~.0.0"))
    assert main(_args(run, "--save-every", "2", "--resume")) == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in _records(run)
    ]
    assert [r["step"] for r in _records(run)] == [1, 2, 3, 4]


def test_wandb_offline_run_holds_the_logged_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb").mkdir()
    assert main(_args(tmp_path / "run", "--wandb", "--no-tensorboard", steps=2)) == 0
    (history,) = (tmp_path / "wandb").glob("wandb/offline-run-*/run-*.wandb")
    logged = history.read_bytes()  # protobuf records holding each value as JSON text
    for record in _records(tmp_path / "run"):
        assert json.dumps(record["loss"]).encode() in logged


def test_eval_holds_out_the_end_of_the_tokens(tmp_path: Path) -> None:
    tokens = (np.arange(4000) * 7919 % 251).astype(np.uint16)
    tokens.tofile(tmp_path / "all.bin")
    flags = ("--log-every", "4", "--no-tensorboard")
    evaluate = ("--eval-every", "2", "--eval-fraction", "0.1", "--eval-batches", "2")
    assert (
        main(_args(tmp_path / "eval", "--data", str(tmp_path / "all.bin"), *flags, *evaluate)) == 0
    )
    records = _records(tmp_path / "eval")
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        assert record["eval_loss"] > 0
        assert record["eval_perplexity"] == pytest.approx(math.exp(record["eval_loss"]))
    assert not (tmp_path / "eval" / "tensorboard").exists()
    # Training saw the first 90% only: the same run on those tokens alone, no eval, matches.
    tokens[:3600].tofile(tmp_path / "train.bin")
    assert main(_args(tmp_path / "plain", "--data", str(tmp_path / "train.bin"), *flags)) == 0
    (plain,) = _records(tmp_path / "plain")
    assert (plain["step"], plain["loss"]) == (4, records[-1]["loss"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--eval-every", "-1"], r"--eval-every must be >= 0 and --eval-fraction in \(0, 1\)"),
        (
            ["--eval-every", "2", "--eval-fraction", "1"],
            r"--eval-fraction in \(0, 1\), got 2 and 1",
        ),
        (["--eval-every", "2", "--pp", "2"], r"--eval-every does not run with --pp yet"),
        (["--eval-batches", "0"], r"--eval-batches must be >= 1, got 0"),
        (["--profile-steps", "0"], r"--profile-steps must be >= 1, got 0"),
        (["--eval-every", "2"], r"the held-out tokens \(\d+\) are too few for one eval batch"),
        (
            ["--eval-every", "2", "--eval-fraction", "0.5", "--eval-batches", "40"],
            r"pack into \d+ windows of 17 tokens, fewer than --eval-batches 40 x --batch-size 2",
        ),
        (["--eval-batches", "2"], r"--eval-batches 2 only applies with --eval-every; add it"),
        (["--eval-fraction", "0.1"], r"--eval-fraction 0.1 only applies with --eval-every"),
        (["--profile-steps", "2"], r"--profile-steps 2 only applies with --profile"),
        (["--wandb-project", "x"], r"--wandb-project x only applies with --wandb"),
        (["--profile", "--steps", "1"], r"--profile traces from the second step .* --steps 1"),
        (["--microbatches", "3"], r"--microbatches 3 only applies with --pp"),
        (
            ["--schedule", "dualpipev", "--microbatches", "4"],
            r"--microbatches 4 and --schedule dualpipev only apply with --pp \(a pipeline's",
        ),
    ],
)
def test_bad_watch_flags_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    (tmp_path / "a.txt").write_text("hello d9d " * 200)
    assert main(_args(tmp_path / "run", "--data", str(tmp_path / "a.txt"), *extra)) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err)


def test_wandb_without_the_package_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    assert main(_args(tmp_path / "run", "--wandb")) == 2
    assert capsys.readouterr().err == (
        "d9d train: error: --wandb needs the wandb package: pip install 'd9d[wandb]'\n"
    )


def test_moe_logs_aux_loss_balance_and_eval(tmp_path: Path) -> None:
    extra = ("--model", "moe", "--eval-every", "2", "--no-tensorboard", "--log-every", "2")
    assert main(_args(tmp_path / "run", *extra, steps=2)) == 0
    (record,) = _records(tmp_path / "run")
    assert record["load_balance"] >= 1.0 and record["aux_loss"] > 0
    assert math.isfinite(record["eval_loss"])


def test_profile_writes_a_chrome_trace(tmp_path: Path) -> None:
    assert (
        main(
            _args(
                tmp_path / "run", "--profile", "--profile-steps", "2", "--no-tensorboard", steps=3
            )
        )
        == 0
    )
    trace = json.loads((tmp_path / "run" / "profile" / "rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names


def test_progress_lines_reach_a_file_while_the_run_goes(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    command = [sys.executable, "-m", "d9d", *_args(tmp_path / "run", "--no-tensorboard", steps=500)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        lines: list[str] = []
        while child.poll() is None and time.monotonic() < deadline and len(lines) < 2:
            lines = [line for line in log.read_text().splitlines() if line.startswith("step ")]
            time.sleep(0.2)
        assert child.poll() is None, f"the run ended first:\n{log.read_text()[-2000:]}"
    finally:
        child.kill()
        child.wait()
    assert lines[0].startswith("step 1/500 loss ")
    assert " lr " in lines[0] and " tokens/s " in lines[0] and " step_time " in lines[0]


@pytest.mark.distributed
def test_eval_under_torchrun_fsdp_equals_one_process(tmp_path: Path) -> None:
    flags = ("--eval-every", "2", "--log-every", "2", "--no-tensorboard")
    assert main(_args(tmp_path / "one", *flags)) == 0
    two = tmp_path / "two"
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    command = [*launch, "-m", "d9d", *_args(two, *flags, "--fsdp", "2")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    one_records, two_records = _records(tmp_path / "one"), _records(two)
    assert [r["step"] for r in two_records] == [2, 4]
    for a, b in zip(one_records, two_records, strict=True):
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-5)


def test_neither_d9d_nor_its_train_module_imports_tensorboard_or_wandb() -> None:
    probe = "import sys, d9d, d9d.cli.train._run\nprint(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert not {"tensorboard", "wandb", "torch.utils.tensorboard"} & set(loaded.stdout.split())


def test_tensorboard_of_a_run_restarted_at_step_0_in_its_out_holds_its_steps_once(
    tmp_path: Path,
) -> None:
    """A replica group restarted into its --out learns at its first quorum where it starts
    (``Dashboards(..., first_step=None)``, then ``start_at``): at step 0 after all groups
    restarted, the earlier run's events are dropped from step 1 on."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from d9d.cli._config import TrainConfig
    from d9d.cli.train._watch import Dashboards

    config = TrainConfig(out=tmp_path / "run")
    with Dashboards(config, {}, 0, rank0=True) as first:
        for step in (1, 2, 3):
            first.write({"step": step, "loss": 10.0 + step})
    with Dashboards(config, {}, None, rank0=True) as restarted:
        restarted.start_at(0)
        for step in (1, 2):
            restarted.write({"step": step, "loss": float(step)})
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0)]
