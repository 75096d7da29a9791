"""The weight-grad pass of zero-bubble schedules as one backward pass, not one per param group.

After a stage's input-grad pass, torch's ``stage_backward_input`` splits the stage's params
into *param groups*: params whose grads reach the activation's graph at the same nodes (the
group's *intermediates*), with the grads those nodes received. ``stage_backward_weight`` then
calls ``torch.autograd.grad`` once per group, and every call is a graph task of its own: a
block under ``remat`` (``torch.utils.checkpoint``, which recomputes once per graph task) is
recomputed in each. A Llama block has nine param groups (one per weight), so each of its
microbatches ran its forward eleven times (one forward, one recomputation for the input
grads, nine for the weight grads), measured in ``tests/distributed/test_remat.py``.

:func:`one_param_group` merges the groups into one, so the weight grads take one
``autograd.grad``: a checkpointed block is recomputed once per pass. The grads are the
same: groups share no intermediate and no node between an intermediate and a param (a node
reaching the params of two groups would have put its intermediates in both, merging them),
so each param's grad comes from the same nodes fed the same grads; torch's own clamp
(each intermediate's incoming grads replaced by those it saved, which keeps a grad from
also flowing in from an intermediate upstream of it) applies to the merged group as to
any group with several intermediates.
"""

from __future__ import annotations

from typing import Any

__all__ = ["one_param_group"]


def one_param_group(param_groups: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """``param_groups`` (``stage_backward_input``'s) as one group holding all their params,
    intermediates and saved grads. A group to which no grad came is left out, as torch's
    ``stage_backward_weight`` skips it (its params keep the grads they have)."""
    if not param_groups or len(param_groups) == 1:
        return param_groups
    params: set[Any] = set()
    intermediates: list[Any] = []
    grads: list[Any] = []
    for group in param_groups:
        saved = group.get("grads") or ()
        if not any(g is not None for grad in saved if grad is not None for g in grad):
            continue
        params |= group["params"]
        for node, grad in zip(group["intermediates"], saved, strict=True):
            if grad is not None:
                intermediates.append(node)
                grads.append(grad)
    return [{"params": params, "intermediates": intermediates, "grads": grads}]
