"""The kernel benchmark behind ``d9d bench kernels`` and ``benchmarks/kernels.py``.

Each op of ``_cases`` runs forward, and forward + backward, in every implementation.
A row reports the median of ``reps`` timed runs after ``warmup`` (on a GPU the GPU time of
CUDA graph replays, or events around plain calls for the loss ops and AdamW, with L2
flushed before each run, see ``_time``; wall time on CPU), GB/s from the case's byte count
and its share of the measured device-to-device copy bandwidth, TFLOP/s where the case
counts FLOPs, and peak memory for the loss ops on CUDA. On a GPU at Llama-3 8B shapes the
report also checks issue 5's targets. CPU runs use tiny shapes and exist to exercise the
code path."""

from __future__ import annotations

import datetime
import importlib.metadata
import statistics
import subprocess
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from ...kernels._triton_env import triton_unavailable
from ._cases import OPS, SHAPES, Case, cases
from ._fp8_cases import fp8_cases

__all__ = ["DTYPES", "format_table", "run"]

DTYPES = ("bfloat16", "float16", "float32")
_REPS = {"cuda": (5, 20), "cpu": (1, 2)}  # default (warmup, reps) per device


def _time(
    fn: Callable[[], object], device: str, warmup: int, reps: int, graph: bool
) -> tuple[list[float], str]:
    """``(seconds of each of reps runs, how they were timed)`` after ``warmup`` runs.

    On CUDA, with ``graph`` the runs are replays of a CUDA graph of ``fn`` ("cuda-graph"):
    the GPU's time alone, without the host's dispatch (Python, the registry, autograd);
    without, events around plain calls ("events"), which count the host's dispatch where it
    outlasts the GPU's work. Either way each run follows the zeroing of a 256 MB buffer, as
    in ``triton.testing.do_bench``, which evicts the inputs from L2 and keeps the GPU busy
    for part of the dispatch. On CPU: wall time ("wall").
    """
    for _ in range(warmup):
        fn()
    if device != "cuda":
        times = []
        for _ in range(reps):
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
        return times, "wall"
    run, how = fn, "events"
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        run, how = captured.replay, "cuda-graph"
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for start, end in events:
        flush.zero_()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events], how


def _step(fn, inputs: dict, backward: bool) -> Callable[[], object]:
    """Forward only (under no_grad, so nothing is saved for a backward), or forward+backward."""
    leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        if not backward:
            with torch.no_grad():
                return fn(**inputs)
        out = fn(**inputs)
        outs = [t for t in (out if isinstance(out, tuple | list) else (out,)) if t.requires_grad]
        return torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])

    return step


def _peak_memory(step, device: str) -> int | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _copy_bandwidth(device: str, nbytes: int, warmup: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    # Not from a graph: a captured copy becomes a copy-engine memcpy node, measured 19% slower
    # (2422 vs 3006 GB/s on an H100) than the copy kernel eager code runs.
    times, _ = _time(lambda: dst.copy_(src), device, warmup, reps, graph=False)
    return 2 * nbytes / statistics.median(times) / 1e9


def _measure(
    case: Case,
    device: str,
    warmup: int,
    reps: int,
    copy_gbps: float,
    compile_baseline: bool,
    skip: Collection[str] = (),
) -> list[dict]:
    rows = []
    modes = [("fwd", False)] + ([("fwd+bwd", True)] if case.bytes_fwd_bwd is not None else [])
    impls = {name: fn for name, fn in case.impls.items() if name not in skip}
    if compile_baseline and case.compile_eager:
        impls["compile"] = torch.compile(case.impls["eager"])
    for mode, backward in modes:
        for name, fn in impls.items():
            row: dict[str, Any] = {"op": case.op, "shape": case.shape, "mode": mode, "impl": name}
            try:
                inputs = case.make()
                step = _step(fn, inputs, backward)
                times, row["timing"] = _time(step, device, warmup, reps, case.graph)
                median = statistics.median(times)
                gbps = (case.bytes_fwd_bwd if backward else case.bytes_fwd) / median / 1e9
                row["median_ms"] = _round(median * 1e3)
                row["gbps"] = _round(gbps)
                row["pct_of_copy"] = _round(100 * gbps / copy_gbps)
                flops = case.flops_fwd_bwd if backward else case.flops_fwd
                if flops:
                    row["tflops"] = _round(flops / median / 1e12)
                if backward and case.memory:
                    row["peak_memory_bytes"] = _peak_memory(step, device)
                del inputs, step
            except Exception as error:  # one failing implementation is a result, not a crash
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            rows.append(row)
    return rows


def _check(name: str, value: float, ok: bool) -> dict:
    return {"check": name, "value": value, "ok": ok}


def _checks(rows: list[dict]) -> list[dict]:
    """Issue 5's targets, evaluated on these rows."""
    by_key = {(r["op"], r["shape"], r["mode"], r["impl"]): r for r in rows if "error" not in r}
    checks = []
    for (op, shape, mode, impl), row in by_key.items():
        if impl != "triton":
            continue
        if op in ("rms_norm", "swiglu") and mode == "fwd":
            name = f"{op} {shape} fwd >= 85% of copy bandwidth"
            checks.append(_check(name, row["pct_of_copy"], row["pct_of_copy"] >= 85))
        compiled = by_key.get((op, shape, mode, "compile"))
        if compiled is not None:
            speedup = _round(compiled["median_ms"] / row["median_ms"])
            name = f"{op} {shape} {mode} at least as fast as compile (speedup)"
            checks.append(_check(name, speedup, row["median_ms"] <= compiled["median_ms"]))
        baseline = by_key.get((op, shape, mode, "torch"), {})
        if op == "fused_linear_cross_entropy" and baseline.get("peak_memory_bytes"):
            ratio = _round(row["peak_memory_bytes"] / baseline["peak_memory_bytes"])
            name = f"{op} {shape} peak memory < 1/4 of eager F.linear + F.cross_entropy"
            checks.append(_check(name, ratio, ratio < 0.25))
    return checks


def _validate(device: str, shapes: str, dtype: str, ops: Sequence[str], warmup, reps) -> None:
    if device not in _REPS:
        raise ValueError(f"--device {device!r} is not one of {list(_REPS)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "--device cuda, but this machine has no CUDA device; use --device cpu "
            "(tiny shapes, Triton under its interpreter)"
        )
    if shapes not in SHAPES:
        raise ValueError(f"--shapes {shapes!r} is not one of {list(SHAPES)}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {list(DTYPES)}")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"--only names unknown ops {unknown}: ops are {list(OPS)}")
    if warmup is not None and warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    if reps is not None and reps < 1:
        raise ValueError(f"--reps must be >= 1, got {reps}")


def run(
    *,
    device: str,
    shapes: str,
    dtype: str = "bfloat16",
    ops: Sequence[str] = (),
    warmup: int | None = None,
    reps: int | None = None,
    compile_baseline: bool = True,
    command: str,
    progress: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Times ``ops`` (all if empty) at ``shapes`` on ``device``; returns the report.

    Args:
        device: ``"cuda"`` or ``"cpu"``.
        shapes: a key of :data:`SHAPES`, e.g. ``"llama3-8b"``.
        dtype: activations' dtype name (adamw is always float32).
        ops: op names; empty: all of :data:`OPS`.
        warmup: untimed runs; default 5 on CUDA, 1 on CPU.
        reps: timed runs; default 20 on CUDA, 2 on CPU.
        compile_baseline: also time ``torch.compile`` of the reference (CUDA only).
        command: the command line recorded in the report.
        progress: called with each row as soon as it is measured.

    Returns:
        ``{"benchmark", "device", "torch", "triton", "liger_kernel", "commit", "command",
        "date", "config", "copy_gbps", "unavailable": {impl: why not measured},
        "results": [row, ...], "checks": [...]}``; a row has
        ``op, shape, mode, impl`` and ``median_ms, gbps, pct_of_copy`` (and ``tflops``,
        ``peak_memory_bytes``) or ``error``.

    Raises:
        ValueError: an unknown device, shape set, dtype or op, or negative counts.
    """
    _validate(device, shapes, dtype, ops, warmup, reps)
    warmup = _REPS[device][0] if warmup is None else warmup
    reps = _REPS[device][1] if reps is None else reps
    sizes = SHAPES[shapes]
    on_gpu = device == "cuda"
    name = torch.cuda.get_device_name() if on_gpu else "cpu"
    copy_gbps = _copy_bandwidth(device, 1 << (30 if on_gpu else 20), warmup, reps)
    # The fp8 cases last: their CUDA graphs are new, and a failed capture would leave CUDA's
    # random-number state unusable for the cases after it.
    all_cases = cases(sizes, getattr(torch, dtype), device, liger=on_gpu)
    all_cases += fp8_cases(sizes, getattr(torch, dtype), device)
    selected = [case for case in all_cases if not ops or case.op in ops]
    # Said once in the report, rather than as an error row per op and mode.
    why_not_triton = triton_unavailable(device)
    unavailable = {} if why_not_triton is None else {"triton": why_not_triton}
    rows = []
    for case in selected:
        compile_too = compile_baseline and on_gpu
        for row in _measure(case, device, warmup, reps, copy_gbps, compile_too, unavailable):
            rows.append(row)
            if progress is not None:
                progress(row)
    return {
        "benchmark": "kernels",
        "device": name,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "liger_kernel": _version("liger-kernel"),
        "commit": _commit(),
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {
            "dtype": dtype,
            "warmup": warmup,
            "reps": reps,
            "shapes": shapes,
            "sizes": sizes,
        },
        "copy_gbps": _round(copy_gbps),
        "unavailable": unavailable,
        "results": rows,
        # The targets are for a GPU at Llama sizes: meaningless elsewhere.
        "checks": _checks(rows) if on_gpu and shapes == "llama3-8b" else [],
    }


_COLUMNS = (
    ("op", "op"),
    ("shape", "shape"),
    ("mode", "mode"),
    ("impl", "impl"),
    ("median_ms", "ms"),
    ("gbps", "GB/s"),
    ("pct_of_copy", "% copy"),
    ("tflops", "TFLOP/s"),
)


def format_table(report: dict[str, Any]) -> str:
    """The report's rows as an aligned text table, then its checks, one per line."""
    columns = list(_COLUMNS)
    if any("error" in row for row in report["results"]):
        columns.append(("error", "error"))
    header = [title for _, title in columns]
    lines = [[str(row.get(key, ""))[:80] for key, _ in columns] for row in report["results"]]
    widths = [max(len(cells[i]) for cells in [header, *lines]) for i in range(len(header))]
    text = [
        "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()
        for cells in [header, *lines]
    ]
    text.insert(1, "  ".join("-" * width for width in widths).rstrip())
    text.append(f"device {report['device']}; copy bandwidth {report['copy_gbps']} GB/s")
    text.extend(f"{impl} not measured: {why}" for impl, why in report["unavailable"].items())
    text.extend(
        ("PASS " if check["ok"] else "FAIL ") + f"{check['check']}: {check['value']}"
        for check in report["checks"]
    )
    return "\n".join(text)


def _round(x: float) -> float:
    """Four significant digits."""
    return float(f"{x:.4g}")


def _commit() -> str | None:
    """The short commit of the checkout d9d runs from, or None outside a git checkout."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        )
    except OSError:
        return None
    return result.stdout.strip() or None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
