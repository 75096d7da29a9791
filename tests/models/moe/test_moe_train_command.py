"""``d9d train --model moe``: trains the MoE decoder and logs its aux loss and load balance,
on one process and under ``--cp``/``--pp`` on forked gloo ranks."""

from __future__ import annotations

import functools
import io
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from d9d.cli import main
from d9d.cli._config import TrainConfig
from d9d.cli.train._run import train
from d9d.testing import run_on_ranks


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


_RUN = {"model": "moe", "steps": 4, "batch_size": 4, "seq_len": 32}


def _records(out: Path, **layout: Any) -> torch.Tensor:
    """``[steps, 3]``: each step's loss, aux loss and load balance."""
    config = TrainConfig(out=out, **{**_RUN, **layout})
    records = train(config, console=Console(file=io.StringIO())).records
    return torch.tensor([[r["loss"], r["aux_loss"], r["load_balance"]] for r in records])


@functools.cache
def _one_process() -> torch.Tensor:
    """The one-process run, once per worker (its folder is thrown away)."""
    with tempfile.TemporaryDirectory() as tmp:
        return _records(Path(tmp))


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [{"cp": 2}, {"pp": 2, "schedule": "gpipe", "microbatches": 1}],
    ids=lambda layout: ",".join(f"{k}={v}" for k, v in layout.items()),
)
def test_train_moe_layout_logs_the_metrics_of_one_process(
    layout: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """float32: the losses, aux losses and load balances of every step equal the one-process
    run's at rel 1e-5 (ring attention and the stage cut reorder sums)."""
    expected = _one_process()
    out = tmp_path_factory.mktemp("ranks")
    for got in run_on_ranks(_records, 2, out, method="fork", timeout=300, **layout):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == _RUN["steps"]


@pytest.mark.distributed
def test_train_moe_pipeline_microbatches_keep_the_loss_but_not_the_whole_batch_aux_loss(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``--pp 2`` runs 1F1B over 4 microbatches by default: the first step's cross entropy is
    the one-process run's (same params, the global token mean), while its aux loss, taken per
    microbatch, differs from the whole batch's (that it is the microbatches' mean is checked
    exactly in ``test_moe_distributed.py``, against an accumulation written out by hand)."""
    expected = _one_process()
    out = tmp_path_factory.mktemp("ranks")
    for got in run_on_ranks(_records, 2, out, pp=2, method="fork", timeout=300):
        torch.testing.assert_close(got[0, 0], expected[0, 0], rtol=1e-5, atol=0)
        assert not torch.allclose(got[0, 1], expected[0, 1], rtol=1e-3)
        assert torch.isfinite(got).all() and (got[:, 2] >= 1).all()


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


def test_plan_shows_moe_pipeline_and_context_parallel_layouts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "--model", "moe", "--preset", "tiny", "--pp", "2", "--rows", "60"]) == 0
    out = capsys.readouterr().out
    assert "on 2 simulated ranks: pp=2" in out and "10 of 26 params held by rank 0" in out
    # The step's aux outputs (aux loss, loads) come from the last stage, which rank 0 does
    # not hold: its dry run makes their structure itself and counts the step.
    assert re.search(r"send\s*│\s*pp", out) and "not counted" not in out, out
    assert main(["plan", "--model", "moe", "--preset", "tiny", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "on 2 simulated ranks: cp=2" in out
    assert re.search(r"all_to_all\s*│\s*cp", out), out  # ring attention


def test_plan_shards_the_shared_experts_over_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "moe", "--preset", "tiny", "--tp", "2", "--rows", "60"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 4}
    assert "tp:S(0)" in rows["layers.1.mlp.shared.w_gate.weight"]
    assert "tp:S(1)" in rows["layers.1.mlp.shared.w_down.weight"]
    assert "tp:S" not in rows["layers.1.mlp.experts.w_gate"]
    assert "tp:S" not in rows["layers.1.mlp.router.weight"]
