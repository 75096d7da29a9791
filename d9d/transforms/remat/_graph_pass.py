"""``remat`` under ``d9d.jit``: torch's rematerialization pass over the step's graph.

Blocks that ``remat`` checkpoints are tagged regions of the one forward-loss-backward graph;
torch's pass (``remat_using_tags_for_fwd_loss_bwd_graph``) duplicates their nodes into the
backward part so that the forward's copies die early. It finds the backward part by the
marks ``d9d.core._backward_region`` sets. Functionalization later regenerates some views inside
the backward (those ``DTensor.from_local`` makes of grads) without the marks, which splits
the part in pieces that torch's pass refuses. :func:`rematerialize` closes those gaps and runs
the pass; it is the remat runtime's graph pass, which ``jit`` runs in place of torch's own.
"""

from __future__ import annotations

from torch import fx

from ...core._backward_region import in_backward, mark_backward
from ...errors import PlanError

__all__ = ["rematerialize"]


def rematerialize(graph: fx.GraphModule) -> fx.GraphModule:
    """``graph`` with checkpointed nodes that its backward part uses duplicated there.

    Unmarked nodes between two marked ones join the backward part unless one of them is
    itself checkpointed (then they are a second forward, as microbatches have).

    Raises:
        PlanError: The graph has checkpointed nodes and more than one backward part
            (microbatches), which torch's pass does not take.
    """
    nodes = list(graph.graph.nodes)
    if not any("recompute" in node.meta for node in nodes):
        return graph
    parts, gap, inside = 0, [], False
    for node in nodes:
        if not in_backward(node):
            gap.append(node)
            continue
        if inside and not any("recompute" in n.meta for n in gap):
            for n in gap:
                mark_backward(n)
        else:
            parts += 1
        gap, inside = [], True
    if parts > 1:
        raise PlanError(
            f"d9d.jit cannot rematerialize checkpointed blocks in a step with {parts} "
            "backward passes (microbatches): torch's pass takes one; under jit use remat "
            "without microbatches, or accumulate microbatches without jit"
        )
    from torch._functorch._activation_checkpointing import (
        remat_using_tags_for_fwd_loss_bwd_graph_pass as remat_pass,
    )

    return remat_pass.remat_using_tags_for_fwd_loss_bwd_graph(graph)
