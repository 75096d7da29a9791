"""Flags that ``d9d train`` and ``d9d plan`` both take, with one wording.

Standard library only: the parsers import this module, and ``d9d --help`` imports no
``torch``.
"""

from __future__ import annotations

import argparse
from typing import Any

SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
"""``d9d.transforms.pipeline.SCHEDULES``' names."""

FP8_RECIPES = ("tensorwise", "rowwise", "blockwise")
"""``d9d.transforms.fp8._linear.GRAD_DTYPES``' recipes."""


def add_fp8(parser: argparse.ArgumentParser) -> None:
    """``--fp8 RECIPE`` and what it chooses: ``--fp8-include``, ``--fp8-exclude`` (regexes of
    module paths, ``d9d.fp8``'s ``include``/``exclude``), ``--fp8-gather``."""
    parser.add_argument(
        "--fp8",
        choices=FP8_RECIPES,
        default=None,
        metavar="RECIPE",
        help="compute the blocks' linears and routed experts in fp8 (d9d.fp8): tensorwise, "
        "rowwise or blockwise; params and optimizer state keep their dtype (default: off)",
    )
    for name, what in (
        ("include", "only the linears and experts modules whose path one of them matches"),
        ("exclude", "not the linears and experts modules whose path one of them matches"),
    ):
        parser.add_argument(
            f"--fp8-{name}",
            nargs="+",
            default=(),
            metavar="PATTERN",
            help=f"with --fp8: {what} (regexes, re.search; e.g. 'mlp.experts' "
            "'layers.0.'): d9d.fp8's {name}= (default: none)".replace("{name}", name),
        )
    parser.add_argument(
        "--fp8-gather",
        action="store_true",
        help="with --fp8 tensorwise over --fsdp (ZeRO-3): all-gather the fp8 linears' weights "
        "as fp8 data + scale (1 byte per element; d9d.fp8's gather_in_fp8=True)",
    )


def fp8_pattern(patterns: tuple[str, ...] | list[str]) -> str | None:
    """One regex matching what any of ``patterns`` matches (None for none)."""
    if not patterns:
        return None
    return "|".join(f"(?:{p})" for p in patterns)


def check_offload_flags(offload: bool, *, jit: bool = False, master_weights: bool = False) -> None:
    """Raise unless ``--offload-opt-state`` composes with the other flags.

    Raises:
        ValueError: with ``--jit`` or ``--master-weights``.
    """
    if not offload:
        return
    for flag, on, why in (
        ("--jit", jit, "the host update runs eagerly"),
        (
            "--master-weights",
            master_weights,
            "the float32 masters would be updated on the host after a clipping on the "
            "device, which master_weights runs inside its own update: not built",
        ),
    ):
        if on:
            raise ValueError(
                f"--offload-opt-state does not combine with {flag} yet ({why}); drop one of them"
            )


def check_fp8_flags(fp8: str | None, include: Any, exclude: Any, gather: bool) -> None:
    """Raise ``ValueError`` naming the flag when an fp8 option is given without ``--fp8``,
    or ``--fp8-gather`` with another recipe than tensorwise."""
    given = [
        flag
        for flag, value in (
            ("--fp8-include", include),
            ("--fp8-exclude", exclude),
            ("--fp8-gather", gather),
        )
        if value
    ]
    if fp8 is None and given:
        raise ValueError(f"{given[0]} chooses what --fp8 computes in fp8; pass --fp8 RECIPE too")
    if gather and fp8 != "tensorwise":
        raise ValueError(
            f"--fp8-gather all-gathers tensorwise fp8 weights only, got --fp8 {fp8}; use "
            "--fp8 tensorwise or drop --fp8-gather"
        )


def add_preset(
    parser: argparse.ArgumentParser, default: str | None, *, shown: str | None = None
) -> None:
    """``--preset``: a model family's named size; ``shown`` is the default the help names
    when ``default`` is None (the command resolves it)."""
    parser.add_argument(
        "--preset",
        default=default,
        help="llama: tiny, small, 1b or 8b; moe: tiny, small, olmoe-1b-7b, qwen3-30b-a3b or "
        f"deepseek-v3 (default {shown or default})",
    )


def add_microbatches(parser: argparse.ArgumentParser) -> None:
    """``--microbatches``: the pipeline's microbatches per step."""
    parser.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="pipeline microbatches per step with --pp (default: 2 x pp)",
    )


def add_zero(parser: argparse.ArgumentParser, default: int) -> None:
    """``--zero``: what ``--fsdp`` shards (``shard_params``' ``shard=``)."""
    parser.add_argument(
        "--zero",
        type=int,
        choices=(1, 2, 3),
        default=default,
        help="what --fsdp shards: 3 params, grads and optimizer state (FSDP); 2 grads and "
        "optimizer state; 1 optimizer state only (shard_params' shard=; 1 and 2 need --fsdp "
        "ranks) (default %(default)s)",
    )


def add_opt_state_dtype(parser: argparse.ArgumentParser, default: str) -> None:
    """``--opt-state-dtype``: the dtype AdamW stores its moments in."""
    parser.add_argument(
        "--opt-state-dtype",
        choices=("float32", "bfloat16"),
        default=default,
        help="bfloat16: AdamW's two moments stored in bf16 (half the optimizer state), "
        "updated in float32 (adamw's mu_dtype, nu_dtype) (default %(default)s)",
    )


def add_master_weights(parser: argparse.ArgumentParser) -> None:
    """``--master-weights``: bfloat16 params, float32 masters in the optimizer state."""
    parser.add_argument(
        "--master-weights",
        action="store_true",
        help="store the params in bfloat16 and keep float32 master copies in the optimizer "
        "state (d9d.optim.master_weights), sharded with it: with --zero 1 or 2 the whole params "
        "take half the bytes (needs --dtype bfloat16 in d9d train)",
    )


def add_offload_opt_state(parser: argparse.ArgumentParser) -> None:
    """``--offload-opt-state``: the optimizer state in host memory, updated there."""
    parser.add_argument(
        "--offload-opt-state",
        action="store_true",
        help="keep AdamW's state in host memory and run its update there, the grads "
        "copied to the host and the updates back (shard_params' opt_state_device='cpu' with "
        "d9d.optim.offloaded); not with --jit or --master-weights",
    )


def add_debug(parser: argparse.ArgumentParser) -> None:
    """``--debug``: raise errors with their traceback."""
    parser.add_argument(
        "--debug", action="store_true", help="on an error, show the traceback, not one line"
    )


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags of a command, without the command's name and ``--debug``."""
    return {k: v for k, v in vars(args).items() if k not in ("command", "debug")}
