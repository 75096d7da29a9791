"""benchmarks/gpu: the smoke run of every stage (what CI runs so that the GPU suite cannot rot
between GPU windows), a failed and a cut-off stage recorded, the profile's timeline arithmetic,
and docs/gpu-benchmarks.md being what benchmarks/results gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
STAGES = ["env", "jit", "kernels", "mfu", "moe", "profile", "fp8", "host_state"]


@pytest.fixture(autouse=True)
def _gpu_scripts_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(GPU))  # the scripts import their siblings by name


def test_smoke_run_writes_every_stage_a_summary_and_the_log(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = os.environ | {"PYTHON": sys.executable}
    start = time.perf_counter()
    done = subprocess.run(
        ["bash", str(GPU / "run.sh"), str(out), "--smoke"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    names = sorted(path.name for path in out.iterdir())
    assert names == sorted([f"{stage}.json" for stage in STAGES] + ["summary.md", "run.log"])
    reports = {stage: json.loads((out / f"{stage}.json").read_text()) for stage in STAGES}
    for stage, report in reports.items():
        assert report["suite"]["status"] == "ok", (stage, report["suite"])
        assert report["suite"]["seconds"] <= report["suite"]["budget_s"]
    assert reports["jit"]["counts"] == {"passed": 1}
    kernel_ops = {row["op"] for row in reports["kernels"]["results"] if "error" not in row}
    assert {"rms_norm", "fused_linear_cross_entropy", "adamw", "grouped_gemm"} <= kernel_ops
    assert {"moe_permute", "moe_unpermute"} <= kernel_ops
    assert {"fp8_quantize", "fp8_gemm", "fp8_grouped_gemm", "fp8_grouped_gemm_k"} <= kernel_ops
    mfu = {row["variant"]: row for row in reports["mfu"]["rows"]}
    assert mfu["d9d"]["losses"] == pytest.approx(mfu["transformers"]["losses"], abs=1e-4)
    assert "torchtitan" in mfu  # recorded, unavailable or failed on a CPU
    assert {row["section"] for row in _moe_rows(reports["moe"])} == {
        "layer", "grouped_gemm", "permute"
    }  # fmt: skip
    assert reports["profile"]["top"] and reports["profile"]["timeline"] is None  # no GPU
    _check_fp8_rows(reports["fp8"]["rows"])
    host = reports["host_state"]["results"]
    assert host["host"]["memory_bytes"]["opt_state_on_device"] == 0
    assert (
        host["host"]["memory_bytes"]["opt_state_on_host"]
        == (host["device"]["memory_bytes"]["opt_state_on_device"])
    )
    text = (out / "summary.md").read_text()
    for stage in STAGES:
        assert f"## {stage} — cpu" in text
    assert "every stage ok" in (out / "run.log").read_text()
    print(f"smoke run: {seconds:.1f} s")


def _check_fp8_rows(rows: list[dict]) -> None:
    """The fp8 stage's rows: every recipe's linear against the baseline's, then the step."""
    linear = {row["recipe"]: row for row in rows if row["part"] == "linear"}
    assert list(linear) == ["bfloat16", "tensorwise", "rowwise", "blockwise"]
    baseline = linear["bfloat16"]["median_ms"]
    for row in linear.values():
        assert row["speedup"] == pytest.approx(baseline / row["median_ms"], rel=1e-2)
        assert min(row[f"{name}_sqnr_db"] for name in ("output", "input_grad", "weight_grad")) > 17
    e2e = {row["recipe"]: row for row in rows if row["part"] == "e2e"}
    assert list(e2e) == ["bfloat16", "tensorwise"]
    ratio = e2e["tensorwise"]["tokens_per_s"] / e2e["bfloat16"]["tokens_per_s"]
    assert e2e["tensorwise"]["ratio_to_bf16"] == pytest.approx(ratio, rel=1e-2)
    assert e2e["tensorwise"]["losses"] == pytest.approx(e2e["bfloat16"]["losses"], rel=0.02)


def _moe_rows(report: dict) -> list[dict]:
    sections = ("layer", "grouped_gemm", "permute")
    return [row | {"section": name} for name in sections for row in report[name]]


@pytest.mark.parametrize("stage", STAGES)
def test_the_gpu_commands_parse(stage: str) -> None:
    """What the smoke run cannot show: each stage's GPU command is one its script accepts."""
    import importlib.util
    import shlex

    from stages import STAGES as ALL

    words = shlex.split(next(s for s in ALL if s.name == stage).gpu.replace("{out}", "x.json"))
    spec = importlib.util.spec_from_file_location(f"stage_{stage}", ROOT / words[0])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script._parser().parse_args(words[1:])


def test_the_gpu_test_list_collects() -> None:
    from stages import JIT_TESTS

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         *JIT_TESTS.split()],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert (
        "tests/core/test_jit.py::" in done.stdout
        and "tests/kernels/test_compile.py::" in done.stdout
    )


def test_a_failed_and_a_cut_off_stage_are_recorded_and_the_next_runs(tmp_path: Path) -> None:
    import suite
    from stages import Stage

    failing = Stage(
        "failing", "prints a row, then fails", 30, gpu="",
        smoke="-c \"import json, sys; print(json.dumps({'row': 1})); sys.exit('broken here')\"",
    )  # fmt: skip
    hanging = Stage(
        "hanging", "prints a row, then hangs", 5, gpu="",
        smoke="-c \"import time; print('{\\\"row\\\": 2}', flush=True); time.sleep(60)\"",
    )  # fmt: skip
    start = time.perf_counter()
    failed = suite.run_stage(failing, tmp_path, smoke=True, budget_s=30)
    # 5 s: a fresh interpreter prints its row within it on a loaded machine.
    cut = suite.run_stage(hanging, tmp_path, smoke=True, budget_s=5)
    assert time.perf_counter() - start < 45  # the hanging stage was stopped at its budget
    assert failed["suite"]["status"] == "failed"
    assert "broken here" in failed["suite"]["error"]
    assert failed["partial_rows"] == [{"row": 1}]
    assert cut["suite"]["status"] == "timed out"
    assert cut["suite"]["error"] == "stopped after its budget of 5 s"
    assert cut["partial_rows"] == [{"row": 2}]
    assert json.loads((tmp_path / "hanging.json").read_text()) == cut
    import summary

    text = summary.render({"failing": failed, "hanging": cut})
    assert "| failing | failed |" in text and "| hanging | timed out |" in text
    assert "1 rows printed before it stopped" in text


def test_unknown_stage_names_are_refused(tmp_path: Path) -> None:
    import suite

    with pytest.raises(SystemExit, match=r"--only names unknown stages \['kernel'\]: stages are"):
        suite.main([str(tmp_path), "--only", "kernel"])
    with pytest.raises(SystemExit, match=r"--budget 'mfu:30': no stage 'mfu:30'"):
        suite.main([str(tmp_path), "--budget", "mfu:30"])


def test_a_stage_with_too_little_of_the_total_left_is_recorded_not_run(tmp_path: Path) -> None:
    import suite

    assert suite.main([str(tmp_path), "--only", "env,jit", "--total", "3"]) == 1
    for stage in ("env", "jit"):
        report = json.loads((tmp_path / f"{stage}.json").read_text())
        assert report["suite"] == {
            "status": "not run",
            "error": "not run: less than 5 s was left of the suite's 3 s",
        }
    assert "| jit | not run |" in (tmp_path / "summary.md").read_text()


def test_the_suite_leaves_no_inductor_cache_folder_or_environment_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its run's inductor cache is a temporary folder, removed at the end (one
    ``d9d-gpu-inductor-*`` folder was left in /tmp per call), and ``os.environ`` is restored."""
    import suite

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    for name in ("TORCHINDUCTOR_CACHE_DIR", "PYTHONUNBUFFERED"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    assert suite.main([str(tmp_path / "out"), "--only", "env", "--total", "3"]) == 1
    assert list(temp.iterdir()) == []
    assert dict(os.environ) == before
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "kept"))
    assert suite.main([str(tmp_path / "out"), "--only", "env", "--total", "3"]) == 1
    assert list(temp.iterdir()) == [] and os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("kept")


def test_timeline_sums_busy_time_and_finds_the_idle_gaps() -> None:
    import profile_step

    def kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "ph": "X"}

    events = [
        kernel("a", 0, 10),
        kernel("b", 5, 10),  # overlaps a: busy 0..15
        kernel("copy", 20, 5, cat="gpu_memcpy"),  # gap of 5 after b
        kernel("c", 45, 5),  # gap of 20 after copy
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100, "ph": "X"},
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 30, "dur": 1},
    ]
    line = profile_step.timeline(events, gaps=1)
    assert line["span_ms"] == 0.05 and line["busy_ms"] == 0.025 and line["idle_ms"] == 0.025
    assert line["gaps"] == 2
    assert line["longest_gaps"] == [{"us": 20.0, "after": "copy", "before": "c"}]
    assert profile_step.timeline(events[4:], gaps=1) is None
    top = profile_step.top_kernels(events, top=2)
    assert [(k["name"], k["calls"], k["total_ms"]) for k in top] == [
        ("a", 1, 0.01), ("b", 1, 0.01)
    ]  # fmt: skip
    assert profile_step.host_syncs(events)["cudaStreamSynchronize"] == 1


def test_the_gpu_page_is_generated_from_the_results() -> None:
    import collect

    assert (ROOT / "docs" / "gpu-benchmarks.md").read_text() == collect.page(), (
        "docs/gpu-benchmarks.md is generated: run python benchmarks/gpu/collect.py"
    )


def test_collect_files_a_gpu_run_and_refuses_a_smoke_run(tmp_path: Path) -> None:
    import collect

    run, results = tmp_path / "run", tmp_path / "results"
    run.mkdir()
    results.mkdir()
    env = {"benchmark": "env", "device": "NVIDIA H200", "packages": {}}
    mfu = {"benchmark": "mfu", "rows": [{"variant": "d9d", "mfu": 0.5}], "config": {}}
    (run / "env.json").write_text(json.dumps(env))
    (run / "mfu.json").write_text(json.dumps(mfu))
    written = collect.copy_run(run, results)
    assert sorted(p.name for p in written) == ["env-nvidia-h200.json", "mfu-nvidia-h200.json"]
    assert collect.gpu_reports(results) == {"nvidia-h200": {"env": env, "mfu": mfu}}
    text = collect.page(results)
    assert "## GPU suite on NVIDIA H200" in text and "### mfu — NVIDIA H200" in text
    (run / "env.json").write_text(json.dumps(env | {"device": "cpu"}))
    with pytest.raises(SystemExit, match="holds a run on 'cpu' \\(a smoke run\\?\\)"):
        collect.copy_run(run, results)


def test_each_gpu_call_fits_one_command_and_the_calls_run_every_stage() -> None:
    import suite
    from stages import CALLS
    from stages import STAGES as STAGE_LIST

    budgets = {stage.name: stage.budget_s for stage in STAGE_LIST}
    for call in CALLS:
        assert sum(budgets[name] for name in call) <= suite.TOTAL_S - 30, call
    assert {name for call in CALLS for name in call} == set(budgets)
