"""fp8 training speed on one GPU (issue 28): one linear's forward and backward against
compiled bf16, then ``d9d train``'s step on a Llama preset under ``d9d.fp8`` against bf16.

Two parts, each row printed as a JSON line as soon as it is measured (a cut keeps the rows):

- ``linear``: for each ``KxN`` of ``--shapes`` (default Llama 3 8B's fused QKV 4096x6144,
  fused gate+up 4096x28672 and down projection 14336x4096) and ``M = --m`` tokens, the
  output, input grad and weight grad of one ``nn.Linear(K, N, bias=False)`` in ``--dtype``:
  plain (``F.linear``, the baseline: bf16 under ``torch.compile``) and through
  ``d9d.transforms.fp8.fp8_linear`` in each recipe (the autograd function ``d9d.fp8`` calls
  for each linear it chooses), each under ``torch.compile`` (``fullgraph``, static shapes,
  compiled afresh) and eagerly, as ``--modes`` says. Median, min and max of ``--reps``
  timed runs after ``--warmup`` (CUDA events on a GPU), TFLOP/s (``6 M K N``), the speedup
  against the baseline (its median over this one's), and the signal to quantization noise
  (dB) of the output, input grad and weight grad against float32 matmuls of the same operands.
- ``e2e``: tokens/s of ``benchmarks/mfu.py``'s ``d9d`` step (``make_train_step``, AdamW,
  ``d9d.jit`` unless ``--eager``) on ``--preset`` cut to ``--layers`` blocks, in bf16 (exactly
  the mfu variant) and under ``d9d.fp8(recipe=...)`` for each of ``--e2e-recipes``, and the
  ratio of each to bf16's tokens/s (issue 28's goal is 1.3 or more: reported, not checked).

    python benchmarks/fp8.py --out benchmarks/results/fp8-h100.json      # needs a GPU
    python benchmarks/fp8.py --device cpu --eager --m 32 --shapes 64x96 --preset tiny --seq 16 \\
        --batch 2 --out /tmp/fp8.json                                     # smoke: emulated fp8
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from report import significant

import d9d
from d9d.cli._train_step import make_train_step
from d9d.transforms.fp8 import fp8_linear

RECIPES = ("tensorwise", "rowwise", "blockwise")
SHAPES = "4096x6144,4096x28672,14336x4096"  # Llama 3 8B: fused QKV, fused gate+up, down
MATMULS = ("output", "input_grad", "weight_grad")
_MFU = Path(__file__).resolve().parent / "mfu.py"


def sqnr_db(want: torch.Tensor, got: torch.Tensor) -> float:
    """Signal to noise of ``got`` against ``want`` in dB: ``10 log10(|want|^2 / |want - got|^2)``,
    in float64; ``inf`` where they are equal.

    Example:
        >>> sqnr_db(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5]))
        20.0
    """
    want, got = want.double(), got.double()
    noise = (want - got).pow(2).sum().item()
    signal = want.pow(2).sum().item()
    return math.inf if noise == 0 else round(10 * math.log10(signal / noise), 2)


def timings(times_s: list[float]) -> dict[str, float]:
    """Median, min and max in milliseconds of run times in seconds."""
    return {
        "median_ms": significant(statistics.median(times_s) * 1e3),
        "min_ms": significant(min(times_s) * 1e3),
        "max_ms": significant(max(times_s) * 1e3),
    }


def time_runs(run: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``run`` after ``warmup`` untimed ones: CUDA events
    on the current stream on a GPU, the wall clock on a CPU."""
    for _ in range(warmup):
        run()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return times
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def _forward(recipe: str | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if recipe is None:
        return lambda x, weight: F.linear(x, weight)
    return lambda x, weight: fp8_linear(x, weight, None, recipe)


def _linear_row(
    forward: Callable, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor,
    exact: tuple[torch.Tensor, ...], args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """One variant's timings and its three matmuls' SQNR against ``exact``."""

    def run() -> tuple[torch.Tensor, ...]:
        out = forward(x, weight)
        return (out, *torch.autograd.grad(out, (x, weight), dy))

    got = run()
    quality = {
        f"{name}_sqnr_db": sqnr_db(want, have)
        for name, want, have in zip(MATMULS, exact, got, strict=True)
    }
    del got
    return timings(time_runs(run, x.device, args.warmup, args.reps)) | quality


def linear_rows(args: argparse.Namespace, device: torch.device) -> Iterator[dict[str, Any]]:
    """The ``linear`` part's rows: per shape, the baseline first, then each recipe's."""
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    for shape in args.shapes.split(","):
        k, n = (int(dim) for dim in shape.split("x"))
        m = args.m
        linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
        weight = linear.weight
        x = torch.randn(m, k, device=device, dtype=dtype, generator=generator).requires_grad_()
        dy = torch.randn(m, n, device=device, dtype=dtype, generator=generator)
        xf, wf, dyf = x.detach().float(), weight.detach().float(), dy.float()
        exact = (xf @ wf.t(), dyf @ wf, dyf.t() @ xf)
        del xf, wf, dyf
        baseline_ms = None
        for recipe in (None, *args.recipes.split(",")):
            for mode in args.modes.split(","):
                row = {"part": "linear", "shape": f"{m}x{k}x{n}", "recipe": recipe or args.dtype}
                row["mode"] = mode
                forward = _forward(recipe)
                try:
                    if mode == "compiled":
                        torch._dynamo.reset()  # each variant compiled afresh: no recompile limit
                        forward = torch.compile(forward, fullgraph=True, dynamic=False)
                    row |= _linear_row(forward, x, weight, dy, exact, args)
                except Exception as error:  # a variant that fails is a result
                    row["error"] = repr(error)[:300]
                if "error" not in row:
                    row["tflop_per_s"] = round(6 * m * k * n / row["median_ms"] / 1e9, 2)
                    if recipe is None and mode == args.modes.split(",")[0]:
                        baseline_ms = row["median_ms"]
                    if baseline_ms is not None:
                        row["speedup"] = significant(baseline_ms / row["median_ms"])
                yield row
        del linear, weight, x, dy, exact


def _mfu_module():
    """``benchmarks/mfu.py``, whose step the ``e2e`` part trains (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("mfu", _MFU)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fp8_step(mfu, config, args: argparse.Namespace, device: torch.device, recipe: str):
    """The mfu ``d9d`` step under ``d9d.fp8(recipe=recipe)``, placed as ``d9d train`` places it."""
    model = mfu._d9d_weights(config, device, getattr(torch, args.dtype))
    opt = d9d.optim.adamw(mfu.LR, weight_decay=mfu.WEIGHT_DECAY)
    step = d9d.fp8(recipe=recipe)(make_train_step(model, opt))
    params, opt_state = step.place(model.params, opt.init(model.params), model=model)
    step = step if args.eager else d9d.jit(step)
    state = {"params": params, "opt": opt_state}

    def run(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        state["params"], state["opt"], metrics = step(state["params"], state["opt"], batch)
        return metrics["loss"]

    return run


def _e2e_row(
    mfu, recipe: str | None, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    config = mfu.model_config(args)
    data = mfu.batches(config, args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if recipe is None:
        run = mfu.build_d9d(config, args, device)
    else:
        run = _fp8_step(mfu, config, args, device, recipe)
    losses, times = [], []
    for index, batch in enumerate(data):
        mfu._sync(device)
        start = time.perf_counter()
        loss = run(batch)
        mfu._sync(device)
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
            losses.append(round(float(loss), 4))
    row = {"step_ms_" + key.removesuffix("_ms"): value for key, value in timings(times).items()}
    row["tokens_per_s"] = significant(args.batch * args.seq / statistics.median(times))
    row["losses"] = losses
    if device.type == "cuda":
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return row


def e2e_rows(args: argparse.Namespace, device: torch.device) -> Iterator[dict[str, Any]]:
    """The ``e2e`` part's rows: bf16 (``--dtype``) first, then each of ``--e2e-recipes``."""
    mfu = _mfu_module()
    layers = mfu.model_config(args).n_layers
    baseline = None
    for recipe in (None, *[r for r in args.e2e_recipes.split(",") if r]):
        row = {"part": "e2e", "recipe": recipe or args.dtype}
        row |= {"preset": args.preset, "layers": layers, "batch": args.batch, "seq": args.seq}
        torch._dynamo.reset()
        try:
            row |= _e2e_row(mfu, recipe, args, device)
        except Exception as error:  # a variant that fails (out of memory too) is a result
            row["error"] = repr(error)[:300]
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if "error" not in row:
            baseline = row["tokens_per_s"] if recipe is None else baseline
            if baseline is not None:
                row["ratio_to_bf16"] = significant(row["tokens_per_s"] / baseline)
        yield row


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="linear,e2e", help="linear, e2e or both")
    parser.add_argument("--m", type=int, default=8192, help="tokens of the linear")
    parser.add_argument("--shapes", default=SHAPES, help="the linear's KxN, comma-separated")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="the linear's recipes")
    parser.add_argument("--modes", default="compiled,eager", help="compiled, eager or both")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs or steps")
    parser.add_argument("--reps", type=int, default=10, help="timed runs of the linear")
    parser.add_argument("--e2e-recipes", default=",".join(RECIPES), help="beside bf16")
    parser.add_argument("--preset", default="1b", help="a LlamaConfig preset (default 1b)")
    parser.add_argument("--layers", type=int, default=4, help="blocks kept (default 4)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--eager", action="store_true", help="no compilation (smoke runs)")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args = parser.parse_args(argv)
    for option, given, known in (
        ("--parts", args.parts, ("linear", "e2e")),
        ("--recipes", args.recipes, RECIPES),
        ("--e2e-recipes", args.e2e_recipes, RECIPES),
        ("--modes", args.modes, ("compiled", "eager")),
    ):
        unknown = [name for name in given.split(",") if name and name not in known]
        if unknown:
            parser.error(f"{option} {given!r}: unknown {unknown}; choose from {list(known)}")
    args.remat = "none"  # what mfu.build_d9d reads
    if args.eager:
        args.modes = "eager"
    device = torch.device(args.device)
    parts = {"linear": linear_rows, "e2e": e2e_rows}
    rows = []
    for part in args.parts.split(","):
        for row in parts[part](args, device):
            rows.append(row)
            print(json.dumps(row), flush=True)
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    report = {
        "benchmark": "fp8",
        "device": name or device.type,
        "torch": torch.__version__,
        "commit": done.stdout.strip() or "unknown",
        "command": " ".join(["python", "benchmarks/fp8.py", *argv]),
        "dtype": args.dtype,
        "baseline": f"{args.dtype} {args.modes.split(',')[0]}",  # the linear's speedup: over it
        "rows": rows,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
