"""AdamW with its state on the host against AdamW on the device, at a Llama preset's size.

One process, ``shard_params`` over a one-rank ``fsdp`` mesh on ``--device``, each step the
update of every param of the preset (Llama 3.2 1B's 1.24 B by default) from a synthetic grad
(``param * 1e-3``, no forward): once with the state on the device (``adamw``), once with
``opt_state_device="cpu"`` and ``d9d.optim.offloaded(adamw)`` (each step: grads and params
copied to the host, AdamW's foreach ops there, updates copied back). Reports the median
step time after warm-up, the bytes each rank keeps where (``step.memory``), the bytes each
step copies between device and host (grads and params out, updates back: 12 bytes a
float32 param) with their rate, and the largest difference of the two runs' params (the
host's AdamW and the device's round alike only where their kernels do). Rows print as JSON
lines as they come:

    python benchmarks/host_state.py --out benchmarks/results/host_state-h100.json
    python benchmarks/host_state.py --device cpu --preset tiny --steps 2 --warmup 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import d9d
from d9d.models import Llama, LlamaConfig


def _shapes(preset: str) -> dict[str, torch.Size]:
    model = d9d.functionalize(Llama(LlamaConfig.preset(preset), device="meta"))
    return {path: p.shape for path, p in model.params.items()}


def _body(opt: d9d.optim.GradientTransformation):
    def step(params, opt_state, batch):
        del batch
        grads = {k: p * 1e-3 for k, p in params.items()}
        updates, opt_state = opt.update(grads, opt_state, params)
        return d9d.optim.apply_updates(params, updates), opt_state, {}

    return step


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _run(host: bool, shapes: dict, device: torch.device, steps: int, warmup: int) -> dict:
    mesh = d9d.make_mesh(device.type, fsdp=1)
    adamw = d9d.optim.adamw(1e-4, weight_decay=0.1)
    opt = d9d.optim.offloaded(adamw) if host else adamw
    transform = d9d.shard_params(mesh, "fsdp", opt_state_device="cpu" if host else None)
    step = transform(_body(opt))
    g = torch.Generator(device=device).manual_seed(0)
    params = {k: torch.randn(s, generator=g, device=device) * 0.02 for k, s in shapes.items()}
    params, state = step.place(params, opt.init(params))
    memory = step.memory(params, state)
    times = []
    for i in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        params, state, _ = step(params, state, {})
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            print(json.dumps({"variant": "host" if host else "device", "step_s": times[-1]}))
    final = {k: v.to_local().cpu() for k, v in params.items()}
    return {
        "median_step_ms": round(statistics.median(times) * 1e3, 3),
        "steps_ms": [round(t * 1e3, 3) for t in times],
        "memory_bytes": {
            "params": memory.params,
            "grads": memory.grads,
            "opt_state_on_device": memory.opt_state,
            "opt_state_on_host": memory.host_opt_state,
        },
        "_params": final,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="1b", help="a LlamaConfig preset (default 1b)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/host_state.json"))
    return parser


def main() -> None:
    args = _parser().parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    shapes = _shapes(args.preset)
    numel = sum(s.numel() for s in shapes.values())
    results = {}
    for variant, host in (("device", False), ("host", True)):
        results[variant] = _run(host, shapes, device, args.steps, args.warmup)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(
            results["device"].pop("_params").values(),
            results["host"].pop("_params").values(),
            strict=True,
        )
    )
    copied = 12 * numel  # float32 grads and params to the host, updates back
    host_s = results["host"]["median_step_ms"] / 1e3
    results["host"]["copied_bytes_per_step"] = copied if device.type != "cpu" else 0
    results["host"]["copied_gb_per_s_of_step"] = (
        round(copied / host_s / 1e9, 3) if device.type != "cpu" else None
    )
    results["host"]["ratio_to_device"] = round(
        results["host"]["median_step_ms"] / results["device"]["median_step_ms"], 3
    )
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    report = {
        "benchmark": "host_state",
        "device": name or device.type,
        "torch": torch.__version__,
        "commit": done.stdout.strip() or "unknown",
        "command": " ".join(["python", "benchmarks/host_state.py", *sys.argv[1:]]),
        "config": {"preset": args.preset, "params": numel, "dtype": "float32"},
        "max_abs_param_difference": diff,
        "note": "on --device cpu the host is the device: nothing is copied (a smoke run)",
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps({"variant": "summary", **{k: v["median_step_ms"] for k, v in results.items()}})
    )


if __name__ == "__main__":
    main()
