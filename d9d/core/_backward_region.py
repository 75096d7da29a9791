"""The backward part of a ``jit`` graph, marked.

``d9d.jit`` compiles forward, loss, backward and update into one graph, where the grads come
from one opaque ``autograd.grad`` node (``_autodiff``). Graph passes that treat the backward
apart (torch's rematerialization of checkpointed regions, run by a runtime's graph pass)
find it by node marks that Dynamo sets only when it traces ``autograd.grad`` itself, so
:func:`backward_region` sets them around ours; :func:`in_backward` reads them and
:func:`mark_backward` sets them on a node.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import fx

__all__ = ["backward_region", "in_backward", "mark_backward"]

# torch 2.11's passes read the annotation; later versions read the node meta.
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


def mark_backward(node: fx.Node) -> None:
    """Mark ``node`` as part of the graph's backward."""
    node.meta[_META] = True
    node.meta["custom"] = {**node.meta.get("custom", {}), _TAG[0]: _TAG[1]}
