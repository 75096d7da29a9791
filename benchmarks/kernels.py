"""Kernel benchmark: each ``d9d.kernels`` op on Llama-3 8B shapes, Triton vs eager PyTorch,
``torch.compile`` of the reference and Liger-Kernel (when installed).

Reports the median time of ``--reps`` runs after ``--warmup``, achieved GB/s from explicit
byte counts (the bytes an ideal kernel must move: each input read once, each output written
once) as a share of the measured device-to-device copy bandwidth, TFLOP/s for the fused
linear cross-entropy, and peak memory for the cross-entropy ops; checks the issue's
targets; writes JSON to ``benchmarks/results/kernels-<device>.json``. The measuring code is
``d9d/cli/bench/_kernels.py``, shared with ``d9d bench kernels``.

    python benchmarks/kernels.py                      # needs a CUDA device
    python benchmarks/kernels.py --only rms_norm,swiglu --no-compile
    python benchmarks/kernels.py --cpu-smoke --out /tmp/kernels.json   # tiny, Triton interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from d9d.cli.bench import _kernels


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=_kernels.DTYPES)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", default="", help="comma-separated ops, e.g. rms_norm,swiglu")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, interpreter")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv_used = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv_used)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel is decorated
        device, shapes, args.warmup, args.reps = "cpu", "tiny", 1, 2
    elif torch.cuda.is_available():
        device, shapes = "cuda", "llama3-8b"
    else:
        print(
            "benchmarks/kernels.py needs a CUDA device and found none; "
            "run with --cpu-smoke for a tiny check of the code path on CPU",
            file=sys.stderr,
        )
        return 2
    report = _kernels.run(
        device=device,
        shapes=shapes,
        dtype=args.dtype,
        ops=[op for op in args.only.split(",") if op],
        warmup=args.warmup,
        reps=args.reps,
        compile_baseline=not args.no_compile,
        command=" ".join(["python", "benchmarks/kernels.py", *argv_used]),
        progress=lambda row: print(json.dumps(row), flush=True),
    )
    slug = report["device"].lower().replace(" ", "-")
    out = args.out or Path(__file__).parent / "results" / f"kernels-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"copy bandwidth {report['copy_gbps']:.1f} GB/s; wrote {out}")
    for check in report["checks"]:
        print(("PASS " if check["ok"] else "FAIL ") + f"{check['check']}: {check['value']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
