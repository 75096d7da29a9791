"""``d9d bench kernels``: a JSON report and a table; bad arguments are one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from d9d.cli import main
from d9d.kernels import _triton_env

OPS = {
    "adamw",
    "cross_entropy",
    "fp8_gemm",
    "fp8_grouped_gemm",
    "fp8_grouped_gemm_k",
    "fp8_quantize",
    "fused_add_rms_norm",
    "fused_linear_cross_entropy",
    "grouped_gemm",
    "moe_permute",
    "moe_unpermute",
    "rms_norm",
    "rope",
    "swiglu",
}


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton on CPU needs its interpreter; set here so the CLI's default does not leak."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_bench_kernels_writes_a_report_and_prints_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report" / "kernels.json"
    argv = ["bench", "kernels", "--shapes", "tiny", "--warmup", "0", "--reps", "1"]
    argv += ["--no-compile", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    for key in ("device", "torch", "triton", "commit", "date", "copy_gbps"):
        assert report[key] is not None, key
    assert report["command"] == "d9d " + " ".join(argv)
    assert report["config"]["shapes"] == "tiny"
    assert (report["config"]["warmup"], report["config"]["reps"]) == (0, 1)
    rows = report["results"]
    assert [row for row in rows if "error" in row] == []
    assert {row["op"] for row in rows} == OPS
    for op in OPS:
        pairs = {(row["mode"], row["impl"]) for row in rows if row["op"] == op}
        assert {("fwd", "triton"), ("fwd", "eager")} <= pairs, op
        if op != "adamw" and not op.startswith("fp8_"):  # fp8 ops have no backward
            assert ("fwd+bwd", "triton") in pairs, op
    assert all(row["median_ms"] > 0 and row["gbps"] > 0 and row["pct_of_copy"] > 0 for row in rows)
    assert all("tflops" in row for row in rows if row["op"] == "fused_linear_cross_entropy")
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == [
        "op",
        "shape",
        "mode",
        "impl",
        "ms",
        "GB/s",
        "%",
        "copy",
        "TFLOP/s",
    ]
    assert len([line for line in printed if line.startswith("rms_norm ")]) == 8
    assert printed[-1] == f"wrote {out}"


def test_without_triton_the_table_says_once_what_is_not_measured_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It filled the table with a KernelUnavailableError row per op and mode."""
    monkeypatch.setattr(_triton_env, "_installed", lambda: False)
    out = tmp_path / "kernels.json"
    argv = ["bench", "kernels", "--device", "cpu", "--only", "rms_norm,swiglu", "--warmup", "0"]
    assert main([*argv, "--reps", "1", "--no-compile", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    why = "triton is not installed (pip install 'd9d[triton]')"
    assert report["unavailable"] == {"triton": why}
    assert {row["impl"] for row in report["results"]} == {"eager"}
    assert all("error" not in row for row in report["results"])
    printed = capsys.readouterr().out
    assert "error" not in printed.splitlines()[0].split()
    assert printed.count("not installed") == 1 and f"triton not measured: {why}" in printed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--only", "rms_norm,layer_norm"], r"--only names unknown ops \['layer_norm'\]: ops are"),
        (["--reps", "0"], r"--reps must be >= 1, got 0"),
        (["--warmup", "-1"], r"--warmup must be >= 0, got -1"),
        pytest.param(
            ["--device", "cuda"],
            r"--device cuda, but this machine has no CUDA device; use --device cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs no CUDA"),
        ),
    ],
)
def test_bad_bench_argument_is_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["bench", "kernels", "--out", str(tmp_path / "k.json"), *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("d9d bench: error:")
    assert re.search(message, err)
    assert not (tmp_path / "k.json").exists()


def test_unknown_bench_target_is_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "gpus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.search(r"invalid choice: 'gpus' \(choose from '?kernels'?\)", err)
