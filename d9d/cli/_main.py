"""The ``d9d`` command: ``d9d train``, ``d9d plan`` and ``d9d bench kernels``.

The parser imports neither ``torch`` nor the library: ``d9d --help`` answers in a fraction of
a second. Each subcommand is a package (``train/``, ``plan/``, ``bench/``) whose ``_parser``
adds its flags and whose ``_command`` runs it; a ``_command`` is imported only when its
subcommand runs, and imports what it runs when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from ..errors import CheckpointSaveError
from .bench._parser import add_bench_parser
from .plan._parser import add_plan_parser
from .train._parser import add_train_parser

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, with no usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="d9d", description="JAX-style distributed training on PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_train_parser(commands)
    add_plan_parser(commands)
    add_bench_parser(commands)
    return parser


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
    try:
        command = importlib.import_module(f".{args.command}._command", __package__)
        return command.run(args, argv)
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
