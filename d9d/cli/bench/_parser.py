"""``d9d bench``'s flags.

Imports neither ``torch`` nor the library: ``d9d --help`` answers in a fraction of a second.
The choices are the benchmark's own, listed here and checked against it by
tests/cli/test_command_line.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["BENCH_DTYPES", "BENCH_OPS", "BENCH_SHAPES", "add_bench_parser"]

BENCH_SHAPES = ("llama3-8b", "tiny")
"""``d9d.cli.bench._cases.SHAPES``' names."""
BENCH_OPS = (
    "rms_norm",
    "swiglu",
    "fused_add_rms_norm",
    "rope",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "adamw",
    "grouped_gemm",
    "moe_permute",
    "moe_unpermute",
    "fp8_quantize",
    "fp8_gemm",
    "fp8_grouped_gemm",
    "fp8_grouped_gemm_k",
)
"""``d9d.cli.bench._cases.OPS``."""
BENCH_DTYPES = ("bfloat16", "float16", "float32")
"""``d9d.cli.bench._kernels.DTYPES``."""


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``d9d bench`` and its flags to the ``d9d`` command's subcommands."""
    bench = commands.add_parser("bench", help="benchmark d9d's kernels: d9d bench kernels")
    bench.add_argument("target", choices=["kernels"], help="what to benchmark")
    bench.add_argument(
        "--device", choices=["cuda", "cpu"], default=None, help="default: cuda if there is one"
    )
    bench.add_argument(
        "--shapes",
        choices=BENCH_SHAPES,
        default=None,
        help="llama3-8b (default on cuda) or tiny (default on cpu: Triton runs interpreted)",
    )
    bench.add_argument(
        "--dtype",
        choices=BENCH_DTYPES,
        default="bfloat16",
        help="activations' dtype; adamw is float32 (default %(default)s)",
    )
    bench.add_argument("--only", default="", help=f"comma-separated ops of {', '.join(BENCH_OPS)}")
    bench.add_argument("--warmup", type=int, default=None, help="default 5 on cuda, 1 on cpu")
    bench.add_argument("--reps", type=int, default=None, help="default 20 on cuda, 2 on cpu")
    bench.add_argument(
        "--no-compile", action="store_true", help="skip the torch.compile baseline (cuda only)"
    )
    bench.add_argument(
        "--out", type=Path, default=None, help="JSON report (default: ./kernels-<device>.json)"
    )
