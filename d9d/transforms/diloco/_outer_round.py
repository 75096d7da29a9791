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
    weighed = [
        _pseudo_gradient(a, p) * tokens_like(weight, _local(a))
        for a, p in zip(anchor_leaves, tree.leaves(params), strict=True)
    ]
    averaged, _ = token_mean_over_groups(manager, weighed, weight)
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


def _pseudo_gradient(anchor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``anchor - param`` of this rank's pieces, in float32 at least: a bfloat16 difference,
    times a token count, summed over the groups and divided, would round at each of those
    (a lone group's plain-average round moved 10004 of the 79040 bfloat16 params of a
    one-layer tiny Llama, by up to 1.2e-4), where float32 holds the difference of two
    bfloat16 values and the outer step rounds once, into the anchor's dtype."""
    wide = torch.promote_types(anchor.dtype, torch.float32)
    return _local(anchor).to(wide) - _local(param).to(wide)


def _local(leaf: torch.Tensor) -> torch.Tensor:
    return leaf.to_local() if isinstance(leaf, DTensor) else leaf
