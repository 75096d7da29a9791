"""The backward part of a ``jit`` graph, and torch's rematerialization pass over it.

``d9d.jit`` compiles forward, loss, backward and update into one graph, where the grads come
from one opaque ``autograd.grad`` node (``_autodiff``). Blocks that ``remat`` checkpoints
are tagged regions of that graph; torch's pass
(``remat_using_tags_for_fwd_loss_bwd_graph``) duplicates their nodes into the backward part
so that the forward's copies die early. The pass finds the backward part by node marks that
Dynamo sets only when it traces ``autograd.grad`` itself, so :func:`backward_region` sets
them around ours. Functionalization later regenerates some views inside the backward
(those ``DTensor.from_local`` makes of grads) without the marks, which splits the part in
pieces that torch's pass refuses. :func:`rematerialize` closes those gaps and runs the pass:
``jit`` turns torch's own run of it off and runs this one on the graph it compiles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import fx

from .errors import PlanError

__all__ = ["backward_region", "in_backward", "rematerialize"]

# torch 2.11's pass reads the annotation; later versions read the node meta.
_TAG = ("remat_pass_tag", "is_backward")
_META = "autograd_backward"


@contextlib.contextmanager
def backward_region() -> Iterator[None]:
    """Marks the ops traced inside as the backward part of the graph (nothing when not
    tracing; the marks live in torch's one process-wide dict of the node being traced)."""
    if not torch.fx.traceback.has_preserved_node_meta():
        yield
        return
    meta = torch.fx.traceback.current_meta
    had = meta.get(_META, False)
    meta[_META] = True
    try:
        with torch.fx.traceback.annotate(dict([_TAG])):
            yield
    finally:
        if had:
            meta[_META] = had
        else:
            meta.pop(_META, None)


def in_backward(node: fx.Node) -> bool:
    """Whether ``node`` is marked as part of the graph's backward."""
    return node.meta.get(_META, False) or node.meta.get("custom", {}).get(_TAG[0]) == _TAG[1]


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
                n.meta[_META] = True
                n.meta["custom"] = {**n.meta.get("custom", {}), _TAG[0]: _TAG[1]}
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
