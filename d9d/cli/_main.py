"""The ``d9d`` command: ``d9d train``, ``d9d plan`` and ``d9d bench kernels``.

The parser imports neither ``torch`` nor the library: ``d9d --help`` answers in a fraction of
a second. Each command imports what it runs when it runs; the choices the parser offers are
listed here and checked against the library's own by tests/cli/test_command_line.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from ..errors import CheckpointSaveError
from ._config import TrainConfig
from ._native_warnings import native_warnings_dropped
from ._plan_checks import AXES, check_layout
from ._train_checks import check_flags

__all__ = ["BENCH_DTYPES", "BENCH_OPS", "BENCH_SHAPES", "FP8_RECIPES", "SCHEDULE_NAMES", "main"]

SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zb", "zbv")
FP8_RECIPES = ("tensorwise", "rowwise", "blockwise")
"""``d9d.transforms.pipeline.SCHEDULES``' names."""
BENCH_SHAPES = ("llama3-8b", "tiny")
"""``d9d.kernels._bench_cases.SHAPES``' names."""
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
)
"""``d9d.kernels._bench_cases.OPS``."""
BENCH_DTYPES = ("bfloat16", "float16", "float32")
"""``d9d.kernels._bench.DTYPES``."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, with no usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="d9d", description="JAX-style distributed training on PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = commands.add_parser("train", help="train a Llama preset on a token corpus")
    defaults = TrainConfig()
    run.add_argument(
        "--preset",
        default=defaults.preset,
        help="llama: tiny, small, 1b or 8b; moe: tiny, small, olmoe-1b-7b, qwen3-30b-a3b or "
        "deepseek-v3 (default %(default)s)",
    )
    run.add_argument(
        "--model",
        choices=["llama", "moe"],
        default=defaults.model,
        help="model family; moe logs its aux loss and expert load balance (default %(default)s)",
    )
    run.add_argument(
        "--steps", type=int, default=defaults.steps, help="optimizer steps (default %(default)s)"
    )
    run.add_argument(
        "--lr", type=float, default=defaults.lr, help="peak learning rate (default %(default)s)"
    )
    run.add_argument(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        help="sequences per step (default %(default)s)",
    )
    run.add_argument(
        "--seq-len",
        type=int,
        default=defaults.seq_len,
        help="tokens per sequence (default %(default)s)",
    )
    run.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="init and data-order seed (default %(default)s)",
    )
    run.add_argument(
        "--out", type=Path, default=defaults.out, help="output folder (default %(default)s)"
    )
    run.add_argument(
        "--data",
        type=Path,
        default=None,
        help="text file or folder, or a .bin uint16 token file (default: the Python standard library sources)",
    )
    run.add_argument(
        "--vocab-size", type=int, default=None, help="override the preset's vocab size"
    )
    run.add_argument(
        "--warmup", type=int, default=defaults.warmup, help="warmup steps (default %(default)s)"
    )
    run.add_argument(
        "--weight-decay",
        type=float,
        default=defaults.weight_decay,
        help="AdamW weight decay (default %(default)s)",
    )
    run.add_argument(
        "--clip",
        type=float,
        default=defaults.clip,
        help="global grad-norm clip (default %(default)s)",
    )
    run.add_argument("--jit", action="store_true", help="compile the whole step with torch.compile")
    run.add_argument(
        "--log-every",
        type=int,
        default=defaults.log_every,
        help="steps between logged losses (default %(default)s)",
    )
    run.add_argument(
        "--save-every",
        type=int,
        default=defaults.save_every,
        help="steps between checkpoints in OUT/checkpoints; 0: none (default %(default)s)",
    )
    run.add_argument(
        "--keep", type=int, default=None, help="newest checkpoints to keep (default: all)"
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest readable checkpoint in OUT/checkpoints, if any "
        "(damaged newer ones are skipped with a warning)",
    )
    run.add_argument(
        "--resume-from",
        type=Path,
        default=None,
        metavar="PATH",
        help="continue from this checkpoint folder (OUT/checkpoints/step_N)",
    )
    run.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume although --steps, --lr, --warmup, --preset or another flag that changes "
        "the schedule or the model differs from the run's config.json",
    )
    run.add_argument(
        "--debug", action="store_true", help="on an error, show the traceback, not one line"
    )
    run.add_argument(
        "--dp", type=int, default=None, help="under torchrun: ranks to replicate over (HSDP/DDP)"
    )
    run.add_argument(
        "--fsdp",
        type=int,
        default=None,
        help="under torchrun: ranks to shard over (default: the rest)",
    )
    run.add_argument("--tp", type=int, default=None, help="under torchrun: tensor-parallel ranks")
    run.add_argument("--cp", type=int, default=None, help="under torchrun: context-parallel ranks")
    run.add_argument("--pp", type=int, default=None, help="under torchrun: pipeline stages")
    run.add_argument(
        "--ep",
        type=int,
        default=None,
        help="under torchrun, with --model moe: expert-parallel ranks (routed experts sharded)",
    )
    run.add_argument(
        "--schedule",
        choices=SCHEDULE_NAMES,
        default="1f1b",
        help="pipeline schedule with --pp; interleaved ones and zbv run 2 stages per rank "
        "(default %(default)s)",
    )
    run.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="pipeline microbatches per step with --pp (default: 2 x pp)",
    )
    run.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=defaults.dtype,
        help="bfloat16: params gathered and computed in bf16, float32 master weights and "
        "optimizer state (shard_params' param_dtype) (default %(default)s)",
    )
    run.add_argument(
        "--zero",
        type=int,
        choices=(1, 2, 3),
        default=defaults.zero,
        help="under torchrun, what --fsdp shards: 3 params, grads and optimizer state "
        "(FSDP); 2 grads and optimizer state; 1 optimizer state only (shard_params' shard=) "
        "(default %(default)s)",
    )
    run.add_argument(
        "--opt-state-dtype",
        choices=("float32", "bfloat16"),
        default=defaults.opt_state_dtype,
        help="bfloat16: AdamW's two moments stored in bf16 (half the optimizer state), "
        "updated in float32 (adamw's mu_dtype, nu_dtype) (default %(default)s)",
    )
    run.add_argument(
        "--fp8",
        choices=FP8_RECIPES,
        default=None,
        metavar="RECIPE",
        help="compute the blocks' linears in fp8 (d9d.fp8): tensorwise, rowwise or blockwise; "
        "params and optimizer state keep their dtype (default: off)",
    )
    run.add_argument(
        "--grad-accum",
        type=int,
        default=defaults.grad_accum,
        help="split each step's batch into N microbatches whose grads are summed before one "
        "update (not with --pp, whose --microbatches do that) (default %(default)s)",
    )
    run.add_argument(
        "--dist-timeout",
        type=float,
        default=defaults.dist_timeout,
        help="under torchrun: seconds a collective may wait for a peer before the run stops "
        "with an error (default %(default)s)",
    )
    _add_watch(run, defaults)
    _add_plan(commands)
    _add_bench(commands)
    return parser


def _add_watch(run: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """The flags of what ``d9d train`` records besides losses: dashboards, eval, profile."""
    run.add_argument(
        "--no-tensorboard",
        dest="tensorboard",
        action="store_false",
        help="write no TensorBoard event files (default: OUT/tensorboard, when the "
        "tensorboard package is installed)",
    )
    run.add_argument(
        "--wandb",
        action="store_true",
        help="also log to Weights & Biases (WANDB_MODE=offline keeps the run in OUT/wandb)",
    )
    run.add_argument(
        "--wandb-project",
        default=defaults.wandb_project,
        help="W&B project, with --wandb (default %(default)s)",
    )
    run.add_argument(
        "--eval-every",
        type=int,
        default=defaults.eval_every,
        help="steps between evaluations on held-out tokens (eval_loss, eval_perplexity); "
        "0: none, and no tokens held out (default %(default)s)",
    )
    run.add_argument(
        "--eval-fraction",
        type=float,
        default=defaults.eval_fraction,
        help="share of the token stream, at its end, held out of training with --eval-every "
        "(default %(default)s)",
    )
    run.add_argument(
        "--eval-batches",
        type=int,
        default=defaults.eval_batches,
        help="held-out batches of --batch-size sequences per evaluation (default %(default)s)",
    )
    run.add_argument(
        "--profile",
        action="store_true",
        help="write a torch.profiler Chrome trace of a few steps to OUT/profile/rankR.json",
    )
    run.add_argument(
        "--profile-steps",
        type=int,
        default=defaults.profile_steps,
        help="steps traced with --profile, after one warmup step (default %(default)s)",
    )


def _add_plan(commands: argparse._SubParsersAction) -> None:
    show = commands.add_parser(
        "plan",
        help="print the plan, per-rank memory and collectives of a layout on simulated ranks",
    )
    show.add_argument(
        "--preset",
        default="8b",
        help="llama: tiny, small, 1b or 8b; moe: tiny, small, olmoe-1b-7b, qwen3-30b-a3b or "
        "deepseek-v3 (default %(default)s)",
    )
    show.add_argument(
        "--model", choices=["llama", "moe"], default="llama", help="model family (default llama)"
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
    show.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="pipeline microbatches per step with --pp (default: 2 x pp)",
    )
    show.add_argument(
        "--zero",
        type=int,
        choices=(1, 2, 3),
        default=3,
        help="what --fsdp shards, as d9d train takes it: 3 params, grads and optimizer "
        "state; 2 grads and optimizer state; 1 optimizer state only (default %(default)s)",
    )
    show.add_argument(
        "--opt-state-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="AdamW's moments' dtype, as d9d train takes it (default %(default)s)",
    )
    show.add_argument("--rows", type=int, default=24, help="table rows to show (default 24)")
    show.add_argument(
        "--debug", action="store_true", help="on an error, show the traceback, not one line"
    )


def _add_bench(commands: argparse._SubParsersAction) -> None:
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


def _bench_kernels(args: argparse.Namespace, argv: Sequence[str]) -> None:
    import torch

    from ..kernels import _bench

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        # Triton runs on CPU only under its interpreter, which must be chosen before the
        # first kernel is compiled: in a `d9d bench` process that is still to come.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    report = _bench.run(
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
    print(_bench.format_table(report))
    print(f"wrote {out}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``d9d`` command line; returns the exit code.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 2 on a bad argument or input, 1 on another failure (a non-finite
        loss, a failed checkpoint save, a file system error), 143 when SIGTERM stopped
        ``d9d train`` after committing a checkpoint (continue with ``--resume``); errors
        are one line on standard error (``--debug``: raised, with the traceback).

    Example:
        >>> main(["train", "--steps", "0"])
        2
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    options = {k: v for k, v in vars(args).items() if k not in ("command", "debug")}
    try:
        if args.command == "bench":
            _bench_kernels(args, argv)
            return 0
        if args.command == "plan":
            axes = {name: options[name] for name in (*AXES, "ep", "world")}
            check_layout(args.model, args.remat, args.hf_config, **axes)
            from ._plan_command import show_plan

            with native_warnings_dropped():
                table = show_plan(
                    **{k: v for k, v in options.items() if k != "rows"}, max_rows=args.rows
                )
            print(table)
            return 0
        check_flags(TrainConfig(**options))
        from ._train import train
        from ._train_preempt import PREEMPTED_EXIT_CODE

        config = TrainConfig(**options)
        run = train(config)
    except (ValueError, KeyError, FileNotFoundError) as error:
        if debug:
            raise
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"d9d {args.command}: error: {' '.join(str(message).split())}", file=sys.stderr)
        return 2
    except (ArithmeticError, RuntimeError, OSError) as error:  # a failure, not a bad input
        if debug:
            raise
        known = isinstance(error, FloatingPointError | CheckpointSaveError | OSError)
        message = str(error) if known else f"{type(error).__name__}: {error}"
        print(
            f"d9d {args.command}: error: {' '.join(message.split())} (--debug for the traceback)",
            file=sys.stderr,
        )
        return 1
    code = PREEMPTED_EXIT_CODE if run.preempted else 0
    if int(os.environ.get("RANK", "0")) != 0:
        return code
    from ._train_report import written_files

    wrote = written_files(config, run.first_step)
    if not run.records:
        print(
            f"nothing to do: {args.out}/checkpoints already holds step {args.steps} or later; {wrote}"
        )
        return 0
    first, last = run.records[0], run.records[-1]
    print(
        f"loss {first['loss']:.3f} -> {last['loss']:.3f} in {run.last_step - run.first_step} "
        f"steps ({run.first_step + 1}-{run.last_step}), {last['elapsed_s']:.1f} s; {wrote}"
    )
    return code
