"""``d9d train --model moe``: trains the MoE decoder and logs its aux loss and load balance."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from d9d.cli import main


def test_train_moe_logs_aux_loss_and_load_balance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", "--model", "moe", "--preset", "tiny", "--steps", "3", "--batch-size", "2"]
    assert main([*args, "--seq-len", "16", "--out", str(tmp_path / "run")]) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["aux_loss"] > 0
        assert record["load_balance"] >= 1.0  # max over mean expert load
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"] == "moe"
    out = capsys.readouterr().out  # not a terminal: the plain progress lines
    assert re.search(r"aux_loss \d\.\d{4} load_balance \d+\.\d{4}", out), out


def test_train_moe_rejects_a_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--model", "moe", "--pp", "2"]) == 2
    assert "--model moe runs without --pp and --cp" in capsys.readouterr().err


def test_train_moe_resumes_with_the_losses_of_an_uninterrupted_run(tmp_path: Path) -> None:
    """The router bias is a param: the checkpoint holds it, so a resumed run routes alike."""
    args = ["train", "--model", "moe", "--steps", "4", "--batch-size", "2", "--seq-len", "16"]
    args += ["--save-every", "2", "--out", str(tmp_path / "run")]
    assert main(args) == 0
    whole = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_4")
    assert main([*args, "--resume"]) == 0
    resumed = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()

    def losses(lines: list[str]) -> list[tuple[float, float]]:
        return [(json.loads(r)["loss"], json.loads(r)["aux_loss"]) for r in lines]

    assert losses(resumed) == losses(whole)


def test_plan_shows_a_moe_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "moe", "--preset", "tiny", "--fsdp", "2", "--rows", "60"]) == 0
    out = capsys.readouterr().out
    assert "on 2 simulated ranks: fsdp=2" in out
    assert "router.expert_bias" in out and "memory on rank 0 (AdamW" in out


def test_plan_shards_the_shared_experts_over_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "moe", "--preset", "tiny", "--tp", "2", "--rows", "60"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 4}
    assert "tp:S(0)" in rows["layers.1.mlp.shared.w_gate.weight"]
    assert "tp:S(1)" in rows["layers.1.mlp.shared.w_down.weight"]
    assert "tp:S" not in rows["layers.1.mlp.experts.w_gate"]
    assert "tp:S" not in rows["layers.1.mlp.router.weight"]
