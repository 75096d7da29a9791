"""One training step run on the meta device of a simulated world, to count what it moves.

Every tensor is a meta tensor and every collective returns at once (``fake_world``), so a
step of an 8B model on 1024 simulated ranks runs in seconds with no memory: shapes, DTensor
placements and the collectives they issue are real, values are not. The few values the step
reads back to Python (the loss's check of out-of-vocab labels) read as 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._comms import CollectiveCounter, CommStats
from .._context import running
from .._step import TransformedStep

__all__ = ["count_collectives"]


class _MetaScalars(TorchDispatchMode):
    """Reads a meta scalar as 0 (False) instead of raising."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return False if args[0].dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))


def count_collectives(
    step: TransformedStep, params: Any, opt_state: Any, batch: dict[str, torch.Tensor]
) -> CommStats:
    """The collectives one call of ``step`` issues on this rank, per kind and mesh axis,
    as ``step.comms`` counts them, run on meta tensors (the batch check across ranks, which
    needs real values, is left out: it runs once, not every step)."""
    labels = {k: v for r in step.runtimes for k, v in r.group_labels().items()}
    counter = CollectiveCounter(step.mesh, labels)
    with counter, _MetaScalars(), running(step.context()):
        step.run(params, opt_state, batch)
    return counter.stats
