"""What ``d9d plan`` runs: the layout checked before ``torch`` is imported, then the plan's
table printed."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .._native_warnings import native_warnings_dropped
from .._options import flag_values
from ._checks import AXES, check_layout

__all__ = ["run"]


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Print the plan, memory and collectives of the flags' layout; returns 0."""
    options = flag_values(args)
    axes = {name: options[name] for name in (*AXES, "world")}
    check_layout(args.model, args.remat, args.hf_config, preset=args.preset, **axes)
    from ._show import show_plan

    with native_warnings_dropped():
        table = show_plan(**{k: v for k, v in options.items() if k != "rows"}, max_rows=args.rows)
    print(table)
    return 0
