"""What ``d9d bench kernels`` runs: the kernel benchmark on this machine's device, its JSON
report and its table."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from . import _kernels

__all__ = ["run"]


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Benchmark the kernels; writes the JSON report, prints its table and returns 0."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        # Triton runs on CPU only under its interpreter, which must be chosen before the
        # first kernel is compiled: in a `d9d bench` process that is still to come.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    report = _kernels.run(
        device=device,
        shapes=args.shapes or ("llama3-8b" if device == "cuda" else "tiny"),
        dtype=args.dtype,
        ops=[op.strip() for op in args.only.split(",") if op.strip()],
        warmup=args.warmup,
        reps=args.reps,
        compile_baseline=not args.no_compile,
        command=" ".join(["d9d", *argv]),
        progress=lambda row: print(
            f"{row['op']} {row['shape']} {row['mode']} {row['impl']}: "
            + (f"{row['median_ms']} ms" if "error" not in row else "error"),
            file=sys.stderr,
            flush=True,
        ),
    )
    slug = report["device"].lower().replace(" ", "-")
    out = args.out or Path(f"kernels-{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(_kernels.format_table(report))
    print(f"wrote {out}")
    return 0
