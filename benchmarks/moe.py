"""MoE layer benchmark: ``d9d.moe.MoE`` forward + backward per ``grouped_gemm`` backend.

Times the whole layer (router, permute, three grouped GEMMs, unpermute, shared expert, aux
losses) on the MoE layer shapes of the d9d ``tiny`` and ``small`` presets, and reports the
median step time, tokens/s and the achieved GFLOP/s of the routed experts, from the explicit
count ``3 matmuls x 2 x (T * top_k) x dim x expert_dim`` forward, times 3 for forward +
backward (the reference backend does ``E`` times that work; the count is the useful work).
The Triton backend runs on CUDA (on CPU only under the interpreter: ``--triton``, slow).

    python benchmarks/moe.py                       # CPU: reference and torch._grouped_mm
    python benchmarks/moe.py --tokens 1024 --reps 10 --out /tmp/moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import d9d
from d9d.models import MoEConfig
from d9d.moe import MoE


def _shapes() -> dict[str, d9d.moe.MoEConfig]:
    return {"d9d-tiny": MoEConfig.tiny().moe, "d9d-small": MoEConfig.small().moe}


def _time(layer: MoE, x: torch.Tensor, warmup: int, reps: int) -> list[float]:
    times = []
    for i in range(warmup + reps):
        start = time.perf_counter()
        out = layer(x)
        (out.out.square().mean() + out.aux_loss).backward()
        if x.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
    return times


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv_used = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per call")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--triton", action="store_true", help="also the Triton backend")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv_used)
    if args.triton:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = ["reference", "torch"] + (["triton"] if args.triton or device.type == "cuda" else [])
    results = []
    for shape, config in _shapes().items():
        layer = MoE(config, device=device)
        x = torch.randn(args.tokens, config.dim, device=device)
        flops = 3 * 3 * 2 * args.tokens * config.top_k * config.dim * config.expert_dim
        for backend in backends:
            with d9d.kernels.use(grouped_gemm=backend):
                times = _time(layer, x, args.warmup, args.reps)
            median = statistics.median(times)
            row = {
                "shape": shape,
                "backend": backend,
                "tokens": args.tokens,
                "median_ms": round(median * 1e3, 3),
                "min_ms": round(min(times) * 1e3, 3),
                "tokens_per_s": round(args.tokens / median),
                "expert_gflop_per_s": round(flops / median / 1e9, 2),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report = {
        "benchmark": "moe",
        "device": f"{name} ({platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "commit": _commit(),
        "command": " ".join(["python", "benchmarks/moe.py", *argv_used]),
        "config": {
            shape: {k: getattr(c, k) for k in ("dim", "n_experts", "top_k", "expert_dim")}
            | {"shared_dim": c.shared_dim, "score_func": c.score_func}
            for shape, c in _shapes().items()
        },
        "results": results,
    }
    slug = "cpu" if device.type == "cpu" else name.lower().replace(" ", "-")
    out = args.out or Path(__file__).parent / "results" / f"moe-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
