"""One training step run on the meta device of a simulated world, to count what it moves.

Every tensor is a meta tensor and every collective returns at once (``fake_world``), so a
step of an 8B model on 1024 simulated ranks runs in seconds with no memory: shapes, DTensor
placements and the collectives they issue are real, values are not. The few values the step
reads back to Python (the loss's check of out-of-vocab labels) read as 0. A pipeline step
runs its schedule too: its sends and receives between stages complete at once, and the
pipeline supplies what peers would have told it (``transforms/pipeline/_stage_shapes.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._comms import CollectiveCounter, CommStats
from .._context import running
from .._step import TransformedStep

__all__ = ["count_collectives", "group_labels"]


class _MetaScalars(TorchDispatchMode):
    """Reads a meta scalar as 0 (False) instead of raising."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return False if args[0].dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))


def group_labels(step: TransformedStep) -> dict[str, str]:
    """The mesh axis of every process group ``step`` runs collectives on, by group name:
    its mesh's and its runtimes' own (a tied param's pair of stages)."""
    mesh = step.mesh
    labels = {mesh.get_group(name).group_name: name for name in mesh.mesh_dim_names or ()}
    for runtime in step.runtimes:
        labels.update(runtime.group_labels())
    return labels


def count_collectives(
    step: TransformedStep,
    params: Any,
    opt_state: Any,
    batch: dict[str, torch.Tensor],
    *,
    known: Mapping[str, str] | None = None,
) -> CommStats:
    """The collectives one call of ``step`` issues on this rank, per kind and mesh axis,
    as ``step.comms`` counts them, run on meta tensors (the batch check across ranks, which
    needs real values, is left out: it runs once, not every step).

    ``known``: axes of the groups of steps built before this one on meshes of the same
    layout. DTensor caches sharding decisions by mesh layout, not identity, so an op of
    this step can hand back a DTensor on an earlier step's equal mesh, whose collectives
    then run on that mesh's groups (``d9d plan`` builds up to three steps)."""
    labels = {**(known or {}), **group_labels(step)}
    counter = CollectiveCounter(step.mesh, labels)
    with counter, _MetaScalars(), running(step.context()):
        step.run(params, opt_state, batch)
    return counter.stats
