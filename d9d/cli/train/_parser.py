"""``d9d train``'s flags.

Imports neither ``torch`` nor the library: ``d9d --help`` answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .._config import TrainConfig
from .._options import (
    FP8_RECIPES,
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

__all__ = ["FP8_RECIPES", "add_train_parser"]


def add_train_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``d9d train`` and its flags to the ``d9d`` command's subcommands."""
    run = commands.add_parser("train", help="train a Llama preset on a token corpus")
    defaults = TrainConfig()
    add_preset(run, defaults.preset)
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
        help="text file or folder, or a .bin token file (default: the Python standard library sources)",
    )
    run.add_argument(
        "--token-dtype",
        choices=("uint16", "uint32"),
        default=defaults.token_dtype,
        help="the ids of a .bin --data file: uint16 (nanoGPT's, vocabularies up to 65,536) or "
        "uint32 (default %(default)s)",
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
        "the schedule or the model differs from the run's config.json (not --batch-size, "
        "--seq-len or --seed, which the saved data position counts in)",
    )
    add_debug(run)
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
        help="pipeline schedule with --pp; interleaved ones, zbv and dualpipev run 2 stages per "
        "rank "
        "(default %(default)s)",
    )
    add_microbatches(run)
    run.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=defaults.dtype,
        help="bfloat16: params gathered and computed in bf16, float32 master weights and "
        "optimizer state (shard_params' param_dtype) (default %(default)s)",
    )
    add_zero(run, defaults.zero)
    add_opt_state_dtype(run, defaults.opt_state_dtype)
    add_master_weights(run)
    add_offload_opt_state(run)
    add_fp8(run)
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
    _add_fault_tolerance(run, defaults)
    _add_watch(run, defaults)


def _add_fault_tolerance(run: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """The flags of a torchft replica group (docs/fault_tolerance.md)."""
    run.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="run as one torchft replica group: grads averaged over the live groups, which "
        "train on when one fails (needs --lighthouse, --replica-group-id, --replica-groups)",
    )
    run.add_argument("--lighthouse", help="the torchft lighthouse's address (http://HOST:PORT)")
    run.add_argument("--replica-group-id", type=int, help="this replica group's index, from 0")
    run.add_argument(
        "--replica-groups",
        type=int,
        help="how many replica groups the job starts (each reads its share of the batch)",
    )
    run.add_argument(
        "--diloco",
        type=int,
        metavar="H",
        help="with --fault-tolerant: DiLoCo, the groups train apart and average their params "
        "every H steps (outer Nesterov SGD, lr 0.7, momentum 0.9; docs/fault_tolerance.md)",
    )
    run.add_argument(
        "--diloco-warmup",
        type=int,
        metavar="W",
        default=defaults.diloco_warmup,
        help="with --diloco H: the first W steps (a multiple of H) each end in a round that "
        "averages the groups' params, before the outer rounds every H steps (default "
        "%(default)s)",
    )


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
