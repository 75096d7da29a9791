"""benchmarks/kernels.py: its CPU smoke mode runs every op and writes a complete report."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("kernels_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the smoke mode needs Triton's interpreter, chosen when the kernels are decorated: "
    "with CUDA, this process decorates them for the GPU",
)
def test_cpu_smoke_writes_a_report(bench, tmp_path):
    out = tmp_path / "kernels.json"
    assert bench.main(["--cpu-smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for key in ("device", "torch", "triton", "commit", "command", "config", "copy_gbps"):
        assert report[key] is not None, key
    assert report["command"] == f"python benchmarks/kernels.py --cpu-smoke --out {out}"
    rows = report["results"]
    assert [row for row in rows if "error" in row] == []
    ops = {row["op"] for row in rows}
    assert ops == {
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
    assert {(row["mode"], row["impl"]) for row in rows if row["op"] == "swiglu"} == {
        ("fwd", "triton"),
        ("fwd", "eager"),
        ("fwd+bwd", "triton"),
        ("fwd+bwd", "eager"),
    }
    assert all(row["gbps"] > 0 and row["median_ms"] > 0 for row in rows)
    assert all("tflops" in row for row in rows if row["op"] == "fused_linear_cross_entropy")
    assert {row["impl"] for row in rows if row["op"] == "fp8_gemm"} == {
        "triton",
        "eager",
        "bf16",
        "torch",
    }


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_cuda_it_says_so(bench, capsys):
    assert bench.main([]) == 2
    assert "needs a CUDA device and found none; run with --cpu-smoke" in capsys.readouterr().err


def test_fp8_gemm_rows_skip_the_compile_baseline():
    """Compiling the dequantize-then-matmul reference would cost the GPU stage's budget for
    a row no one compares with: the fp8 GEMMs' rival is the bfloat16 matmul."""
    from d9d.cli.bench import _kernels
    from d9d.cli.bench._cases import SHAPES
    from d9d.cli.bench._fp8_cases import fp8_cases

    cases = fp8_cases(SHAPES["tiny"], torch.bfloat16, "cpu")
    # tensorwise: torch 2.11's CPU _scaled_mm (the GPU machines' torch) has no rowwise scales.
    gemm = next(case for case in cases if case.op == "fp8_gemm" and "tensorwise" in case.shape)
    rows = _kernels._measure(gemm, "cpu", 0, 1, 1.0, compile_baseline=True, skip=("triton",))
    assert {row["impl"] for row in rows} == {"torch", "eager", "bf16"}
    assert [row for row in rows if "error" in row] == []
    assert {case.op for case in cases if case.compile_eager} == {"fp8_quantize"}
