"""``d9d plan``'s flags.

Imports neither ``torch`` nor the library: ``d9d --help`` answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .._options import (
    SCHEDULE_NAMES,
    add_debug,
    add_fp8,
    add_master_weights,
    add_microbatches,
    add_offload_opt_state,
    add_opt_state_dtype,
    add_preset,
    add_zero,
)
from ._checks import DEFAULT_PRESET

__all__ = ["add_plan_parser"]


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``d9d plan`` and its flags to the ``d9d`` command's subcommands."""
    show = commands.add_parser(
        "plan",
        help="print the plan, per-rank memory and collectives of a layout on simulated ranks",
    )
    add_preset(show, None, shown=DEFAULT_PRESET)  # None: not given (refused with --hf-config)
    show.add_argument(
        "--model", choices=["llama", "moe"], default=None, help="model family (default llama)"
    )
    show.add_argument(
        "--hf-config",
        type=Path,
        default=None,
        metavar="PATH",
        help="a Hugging Face config.json to plan instead of a preset",
    )
    show.add_argument("--dp", type=int, default=1, help="ranks to replicate over (default 1)")
    show.add_argument(
        "--fsdp",
        type=int,
        default=None,
        help="ranks to shard over (default: the rest of --world, or 1)",
    )
    show.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    show.add_argument("--cp", type=int, default=1, help="context-parallel ranks (default 1)")
    show.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    show.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks, --model moe (default 1); all-to-alls for uniform routing",
    )
    show.add_argument(
        "--world", type=int, default=None, help="ranks in all (default: the axes' product)"
    )
    show.add_argument(
        "--batch", type=int, default=1, help="sequences per rank per microbatch (default 1)"
    )
    show.add_argument(
        "--seq",
        type=int,
        help="tokens per sequence (default: the model's max_seq_len, at most 4096)",
    )
    show.add_argument(
        "--remat",
        choices=["none", "selective", "full"],
        default="none",
        help="activation checkpointing of every block (default none)",
    )
    show.add_argument(
        "--schedule",
        choices=SCHEDULE_NAMES,
        default="1f1b",
        help="pipeline schedule with --pp (default %(default)s)",
    )
    add_microbatches(show)
    add_zero(show, 3)
    add_opt_state_dtype(show, "float32")
    add_master_weights(show)
    add_offload_opt_state(show)
    add_fp8(show)
    show.add_argument("--rows", type=int, default=24, help="table rows to show (default 24)")
    add_debug(show)
