"""A short ``torch.profiler`` run of ``benchmarks/mfu.py``'s d9d step: the GPU suite's
``profile`` stage.

The step is built exactly as the mfu benchmark's ``d9d`` variant builds it (``d9d.jit`` of
``make_train_step``, bfloat16 on CUDA), run ``--warmup`` times, then profiled over ``--steps``
steps issued back to back (one synchronize after the last, as a training loop that does
not read its loss runs). Reported:

- ``top``: the kernels with the most GPU time (name, calls, total ms, share of all kernel
  time); on a CPU, where there are no kernels, the operators with the most self CPU time.
- ``timeline``: on a GPU, the span from the first kernel's start to the last one's end, the
  time some kernel, copy or fill ran (``busy_ms``) and the rest (``idle_ms``): time the GPU
  waited on the host; and the longest idle gaps with the kernels on either side.
- ``host_syncs``: CUDA runtime calls that block the host until the GPU catches up
  (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``), counted;
  the one ``cudaDeviceSynchronize`` after the last step is the harness's.

    python benchmarks/gpu/profile_step.py --preset 1b --layers 4 --seq 2048 --batch 8 --out p.json
    python benchmarks/gpu/profile_step.py --device cpu --eager --preset tiny --seq 16 --out p.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

_MFU = Path(__file__).resolve().parents[1] / "mfu.py"
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # chrome-trace categories on the GPU


def _mfu_module():
    """``benchmarks/mfu.py``, the script whose step this profiles (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("mfu", _MFU)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def top_kernels(events: Iterable[dict], top: int) -> list[dict[str, Any]]:
    """The ``top`` kernel names by total GPU time, from chrome-trace events."""
    totals: dict[str, list[float]] = {}
    for event in events:
        if event.get("cat") == "kernel":
            total = totals.setdefault(event["name"], [0, 0.0])
            total[0] += 1
            total[1] += event["dur"]
    all_us = sum(us for _, us in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return [
        {
            "name": name[:120],
            "calls": calls,
            "total_ms": round(us / 1e3, 3),
            "share": round(us / all_us, 4),
        }
        for name, (calls, us) in ranked
    ]


def timeline(events: Iterable[dict], gaps: int) -> dict[str, Any] | None:
    """Busy and idle time of the device from its kernel, copy and fill events (microsecond
    ``ts``/``dur``), and the ``gaps`` longest idle stretches; None if there is no device work."""
    work = sorted(
        (event["ts"], event["ts"] + event["dur"], event["name"])
        for event in events
        if event.get("cat") in _DEVICE_WORK
    )
    if not work:
        return None
    busy, stretches = 0.0, []
    start, end, last_name = work[0]
    for begin, finish, name in work[1:]:
        if begin > end:  # the device was idle from end to begin
            busy += end - start
            stretches.append((begin - end, last_name, name))
            start = begin
        if finish >= end:
            end, last_name = finish, name
    busy += end - start
    span = end - work[0][0]  # end: the latest finish of all
    longest = sorted(stretches, key=lambda s: -s[0])[:gaps]
    return {
        "span_ms": round(span / 1e3, 3),
        "busy_ms": round(busy / 1e3, 3),
        "idle_ms": round((span - busy) / 1e3, 3),
        "idle_share": round((span - busy) / span, 4) if span else 0.0,
        "gaps": len(stretches),
        "longest_gaps": [
            {"us": round(us, 1), "after": before[:80], "before": after[:80]}
            for us, before, after in longest
        ],
    }


def host_syncs(events: Iterable[dict]) -> dict[str, int]:
    """How many times each blocking CUDA runtime call ran."""
    counts = dict.fromkeys(_SYNCS, 0)
    for event in events:
        if event.get("cat") == "cuda_runtime" and event.get("name") in counts:
            counts[event["name"]] += 1
    return counts


def _trace_events(prof: profile) -> tuple[list[dict], str | None]:
    """The chrome-trace events of ``prof``, or none and why (a trace JSON would not parse)."""
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(trace))
        try:
            return json.loads(trace.read_text())["traceEvents"], None
        except (ValueError, KeyError) as error:
            return [], f"the trace did not parse: {error!r}"[:300]


def _top_cpu_ops(prof: profile, top: int) -> list[dict[str, Any]]:
    averages = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:top]
    all_us = sum(a.self_cpu_time_total for a in prof.key_averages()) or 1.0
    return [
        {
            "name": a.key[:120],
            "calls": a.count,
            "total_ms": round(a.self_cpu_time_total / 1e3, 3),
            "share": round(a.self_cpu_time_total / all_us, 4),
        }
        for a in averages
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--layers", type=int, default=None, help="blocks kept (default all)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    # d9d.jit traces again on the second call, whose inputs are the first call's donated
    # outputs (seen on CPU: a profile after one warm-up step held the second trace).
    parser.add_argument("--warmup", type=int, default=3, help="steps before (compilation)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on cuda, else float32")
    parser.add_argument("--eager", action="store_true", help="no d9d.jit (smoke runs)")
    parser.add_argument("--top", type=int, default=15, help="kernels listed")
    parser.add_argument("--gaps", type=int, default=8, help="longest idle gaps listed")
    parser.add_argument("--out", type=Path, required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.remat = "none"
    mfu = _mfu_module()
    device = torch.device(args.device)
    config = mfu.model_config(args)
    data = mfu.batches(config, args, device)
    run = mfu.build_d9d(config, args, device)
    for batch in data[: args.warmup]:
        run(batch)
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for batch in data[args.warmup :]:
            run(batch)
        _sync(device)
        seconds = time.perf_counter() - start
    on_gpu = device.type == "cuda"
    events, trace_error = _trace_events(prof)
    report = {
        "benchmark": "profile",
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "torch": torch.__version__,
        "command": " ".join(["python", "benchmarks/gpu/profile_step.py", *argv]),
        "config": {
            "preset": args.preset,
            "n_layers": config.n_layers,
            "seq": args.seq,
            "batch": args.batch,
            "dtype": args.dtype,
            "jit": not args.eager,
        },
        "steps": args.steps,
        "step_ms": round(seconds / args.steps * 1e3, 2),
        "top_by": "GPU time of kernels" if on_gpu else "self CPU time of operators",
        "top": top_kernels(events, args.top) if on_gpu else _top_cpu_ops(prof, args.top),
        "timeline": timeline(events, args.gaps),
        "host_syncs": host_syncs(events) if on_gpu else None,
        # Dynamo traces inside the profiled steps: not 0 means a step recompiled, and the
        # figures above include compilation (give more --warmup).
        "traces_in_window": sum(
            1 for event in events if str(event.get("name", "")).startswith("bytecode_tracing")
        ),
    }
    if trace_error:
        report["trace_error"] = trace_error
    for row in report["top"]:
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"step {report['step_ms']} ms; timeline {report['timeline']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
