"""One outer round of ``diloco``: the pseudo-gradients averaged over the live replica groups
through the torchft ``Manager`` (each weighed by its group's tokens, or all alike, a group
that rejoined at the round not at all), the outer optimizer applied to the anchor, and the
vote.

Each rank works on its local pieces (a shard per rank under fsdp): every live group holds the
same layout, and ``Manager.allreduce`` pairs rank ``r`` of each group, so the pieces line up.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ... import tree
from ...core._gather import local_like
from ...optim import GradientTransformation, apply_updates
from .._replica_groups import token_mean_over_groups, tokens_like

__all__ = ["outer_round"]


def outer_round(
    manager: Any,
    outer: GradientTransformation,
    anchor: Any,
    outer_state: Any,
    params: Any,
    weight: torch.Tensor,
) -> tuple[Any, Any, bool]:
    """``(anchor, outer_state, committed)`` after one outer round from ``params``.

    The pseudo-gradient is ``anchor - params``, averaged over the live groups, each weighed
    by its ``weight`` over their total (each group's pseudo-gradient times its weight,
    summed with the weights in the same all-reduce, then divided): the valid tokens the
    group trained on in the round, 1 for every group alike, 0 for a group that took its
    peer's state at this round's quorum. The outer optimizer takes it as the anchor's grad.
    When ``manager.should_commit()`` says no (a group failed during the round), the anchor
    and the outer state come back as they were. The caller has started the round's quorum.
    """
    anchor_leaves, spec = tree.flatten(anchor)
    pseudo = [
        _local(a) - _local(p) for a, p in zip(anchor_leaves, tree.leaves(params), strict=True)
    ]
    scale = tokens_like(weight, pseudo[0])
    averaged, _ = token_mean_over_groups(manager, [p * scale for p in pseudo], weight)
    if not manager.should_commit():
        return anchor, outer_state, False
    grads = tree.unflatten(
        spec,
        [
            local_like(g, a) if isinstance(a, DTensor) else g
            for g, a in zip(averaged, anchor_leaves, strict=True)
        ],
    )
    updates, outer_state = outer.update(grads, outer_state, anchor)
    return apply_updates(anchor, updates), outer_state, True


def _local(leaf: torch.Tensor) -> torch.Tensor:
    return leaf.to_local() if isinstance(leaf, DTensor) else leaf
