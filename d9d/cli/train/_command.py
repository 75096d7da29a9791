"""What ``d9d train`` runs: its flags checked before ``torch`` is imported, the run, and the
one-line summary rank 0 prints."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from .._config import TrainConfig
from .._options import flag_values
from ._checks import check_flags

__all__ = ["run"]


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Train as the flags say; returns 0, or ``PREEMPTED_EXIT_CODE`` after a SIGTERM."""
    config = TrainConfig(**flag_values(args))
    check_flags(config)
    from ._preempt import PREEMPTED_EXIT_CODE
    from ._run import train

    result = train(config)
    code = PREEMPTED_EXIT_CODE if result.preempted else 0
    if int(os.environ.get("RANK", "0")) != 0:
        return code
    from ._report import written_files

    wrote = written_files(config, result.first_step)
    if not result.records:
        print(
            f"nothing to do: {args.out}/checkpoints already holds step {args.steps} or later; {wrote}"
        )
        return 0
    first, last = result.records[0], result.records[-1]
    # The first logged step, which is the first step only when --log-every is 1.
    since = "" if first["step"] == result.first_step + 1 else f" (step {first['step']:.0f})"
    print(
        f"loss {first['loss']:.3f}{since} -> {last['loss']:.3f} in "
        f"{result.last_step - result.first_step} steps ({result.first_step + 1}-"
        f"{result.last_step}), {last['elapsed_s']:.1f} s; {wrote}"
    )
    return code
