"""benchmarks/mfu.py on CPU, eager and tiny: every variant trains the same function (equal
losses from the same weights and batches) and the report's figures follow from its times."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def mfu(load_benchmark):
    return load_benchmark("mfu")


def test_transformers_baseline_trains_the_same_function(mfu, tmp_path):
    out = tmp_path / "mfu.json"
    argv = ["--device", "cpu", "--eager", "--preset", "tiny", "--seq", "24", "--batch", "3"]
    argv += ["--steps", "3", "--warmup", "1", "--variants", "d9d,transformers", "--out", str(out)]
    assert mfu.main(argv) == 0
    report = json.loads(out.read_text())
    d9d_row, hf_row = report["rows"]
    assert (d9d_row["variant"], hf_row["variant"]) == ("d9d", "transformers")
    assert d9d_row["losses"] == pytest.approx(hf_row["losses"], abs=1e-4)
    assert len(d9d_row["losses"]) == 3
    for row in report["rows"]:
        tokens = 3 * 24
        assert row["tokens_per_s"] == pytest.approx(tokens / row["step_ms_median"] * 1e3, rel=1e-2)
        flops = report["flops_per_token"] * tokens / (row["step_ms_median"] / 1e3)
        assert row["tflop_per_s"] == pytest.approx(flops / 1e12, abs=0.01)
        assert row["mfu"] is None  # no peak known for a CPU
    assert report["config"] == {"preset": "tiny", "n_layers": 2, "params": 125_248}


def test_batch_option_is_dropped_for_the_child_processes(mfu):
    argv = ["--preset", "1b", "--batch", "auto", "--seq", "8", "--batch=4", "--eager"]
    assert mfu._without_batch(argv) == ["--preset", "1b", "--seq", "8", "--eager"]


def test_no_peak_on_a_cpu(mfu):
    import torch

    assert mfu.peak_flops(torch.device("cpu")) is None


def test_auto_batch_keeps_the_largest_try_that_ran_and_its_row(mfu, monkeypatch):
    tries = []

    def run(variant, args, batch):
        tries.append((variant, batch))
        if batch > 16:
            return {"variant": variant, "batch": batch, "error": "out of memory"}
        return {"variant": variant, "batch": batch, "step_ms_median": 10.0 * batch}

    monkeypatch.setattr(mfu, "_isolated", run)
    args = mfu._parser().parse_args(["--min-batch", "4", "--max-batch", "64"])
    assert mfu._largest_batch(args) == (16, {"variant": "d9d", "batch": 16, "step_ms_median": 160})
    assert tries == [("d9d", 4), ("d9d", 8), ("d9d", 16), ("d9d", 32)]
    args = mfu._parser().parse_args(["--min-batch", "32", "--max-batch", "64"])
    assert mfu._largest_batch(args) == (
        32, {"variant": "d9d", "batch": 32, "error": "out of memory"}
    )  # fmt: skip
