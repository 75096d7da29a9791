"""Regather under ``d9d.jit``: a graph pass that gathers params again for the backward.

``d9d.jit`` traces forward, loss, backward and update into one graph, where a gathered param
is one node that forward and backward ops both read: compiled as it is, the gathered copy
lives from its gather in the forward to its last use in the backward, every block's at once
at the turn of the step, as with ``reshard_after_forward=False``. Eager, saved-tensor hooks
drop it and gather it again (:mod:`._regather`); Dynamo traces no such hooks. So the runtime
marks the nodes its gathers trace (:func:`marked_gather`) and :func:`regather`, its graph
pass, gives each gather's backward readers a copy of the gather's chain, placed before the
first of them: the stored shards' encoding, the all-gather and its wait, the decoding, and
the views the block takes of the result (a linear's transpose), not the block's compute.

As the eager hooks do, the copy gathers only the params of the unit whose gathered copy the
backward reads (a unit's embedding table, which the backward of a lookup does not read, is
left out): their pieces of the all-gather's input are concatenated again and the buffer is
cut at their new offsets. So the compiled step moves the collectives of the eager one, count
and bytes: one regather per gather and backward pass, with microbatches one per microbatch.

A gather inside a checkpointed region (node meta ``recompute``: ``remat``) is left to the
pass that recomputes the region, which gathers again with it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx

from ...core._backward_region import in_backward, mark_backward

__all__ = ["marked_gather", "regather"]

_MARK = "shard_params_gather"
_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
_COLLECTIVES = frozenset(
    op.default
    for op in (
        _c10d.all_gather_into_tensor,
        _c10d.all_reduce,
        _c10d.reduce_scatter_tensor,
        _c10d.all_to_all_single,
        _c10d.wait_tensor,
    )
)


def marked_gather(gather: Callable[..., Any], unit: Any, keys: list[str]) -> Any:
    """``gather(unit, keys)``, its traced nodes marked for :func:`regather`."""
    with torch.fx.traceback.annotate({_MARK: True}):
        return gather(unit, keys)


def regather(graph: fx.GraphModule) -> fx.GraphModule:
    """``graph`` with each marked gather's results that the backward reads gathered again
    there, before the first backward op that reads them."""
    nodes = list(graph.graph.nodes)
    at = {node: i for i, node in enumerate(nodes)}
    turn, seen = _turns(nodes), set()
    for root in nodes:
        if root in seen or not _is_root(root):
            continue
        chain = _chain(root, at, turn[at[root]])
        seen.update(chain)
        late = {
            x: [u for u in x.users if at.get(u, -1) > turn[at[root]]]
            for x in chain
            if x is not root
        }
        late = {x: users for x, users in late.items() if users}
        if not late:
            continue
        first = min((u for users in late.values() for u in users), key=at.__getitem__)
        with graph.graph.inserting_before(first):
            copies = _copy_chain(graph.graph, root, chain, list(late), at)
        for x, users in late.items():
            for user in users:
                user.replace_input_with(x, copies[x])
    graph.graph.lint()
    graph.recompile()
    return graph


def _turns(nodes: list[fx.Node]) -> list[int]:
    """Per position, the position of the first backward op at or after it (past the end
    when none): a use after it reads the value across a backward pass, marked or not (some
    ops of the backward, the gathers' own backward among them, carry no mark)."""
    out, nxt = [len(nodes)] * len(nodes), len(nodes)
    for i in range(len(nodes) - 1, -1, -1):
        if in_backward(nodes[i]):
            nxt = i
        out[i] = nxt
    return out


def _marked(node: fx.Node) -> bool:
    return node.meta.get("custom", {}).get(_MARK, False) and "recompute" not in node.meta


def _is_root(node: fx.Node) -> bool:
    """A marked forward all-gather (the first of a chain: later ones are in its chain), or
    the concatenated shards of a gather over one rank, which are its buffer with no
    collective (``core/_gather.py``'s ``_all_gather``), waited for all the same: copied for
    the backward alike."""
    if not _marked(node) or in_backward(node):
        return False
    if node.target is _c10d.all_gather_into_tensor.default:
        return True
    # The one-rank buffer is waited for as a gather's would be; no other cat is (a codec
    # statistic's, which fp8's gather under jit traces beside its gathers, is not).
    waited = _c10d.wait_tensor.default
    return node.target is _aten.cat.default and any(u.target is waited for u in node.users)


def _is_view(node: fx.Node) -> bool:
    if node.op != "call_function" or "recompute" in node.meta:
        return False
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _chain(root: fx.Node, at: dict[fx.Node, int], turn: int) -> list[fx.Node]:
    """``root`` and the forward nodes its result flows through: the gather's own (marked)
    and the views of them, in graph order."""
    chain, todo = {root}, list(root.users)
    while todo:
        node = todo.pop()
        if node in chain or at.get(node, turn) >= turn:
            continue
        if _marked(node) or (_is_view(node) and all(i in chain for i in node.all_input_nodes)):
            chain.add(node)
            todo.extend(node.users)
    return sorted(chain, key=at.__getitem__)


def _encoding(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """The marked forward nodes among ``nodes`` and those they are computed from (the
    shards' encoding), up to unmarked nodes and collectives (a codec's statistic, all-reduced
    once a step, is read, not reduced again)."""
    found: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node in found or not _marked(node) or in_backward(node):
            continue
        if node.op != "call_function" or node.target in _COLLECTIVES:
            continue
        found.add(node)
        todo.extend(node.all_input_nodes)
    return found


def _ancestors(targets: Iterable[fx.Node], within: set[fx.Node]) -> set[fx.Node]:
    found, todo = set(), list(targets)
    while todo:
        node = todo.pop()
        if node in found or node not in within:
            continue
        found.add(node)
        todo.extend(node.all_input_nodes)
    return found


def _copy_chain(
    graph: fx.Graph,
    root: fx.Node,
    chain: list[fx.Node],
    read: list[fx.Node],
    at: dict[fx.Node, int],
) -> dict[fx.Node, fx.Node]:
    """Copies of the nodes ``read`` is computed from in ``chain`` and the all-gather's input,
    inserted at the graph's insertion point; ``{original: copy}``."""
    downstream = _ancestors(read, set(chain))
    layout = _layout(root)
    kept = None if layout is None else [s for s in layout[2] if s in downstream]
    env: dict[fx.Node, fx.Node] = {}
    if layout is None or len(kept) in (0, len(layout[2])):
        wanted = downstream | _encoding(root.all_input_nodes)
    else:
        pieces, view, slices = layout
        inputs = [pieces[slices.index(s)] for s in kept]
        encoding = _encoding(inputs)
        wanted = (downstream - {root, view, *root.users, *slices}) | encoding
        for node in sorted(encoding, key=at.__getitem__):
            env[node] = _copy(graph, node, env)
        env.update(_fewer(graph, root, view, kept, [env.get(p, p) for p in inputs]))
    for node in sorted(wanted, key=at.__getitem__):
        if node not in env:
            env[node] = _copy(graph, node, env)
    return env


def _copy(graph: fx.Graph, node: fx.Node, env: dict[fx.Node, fx.Node]) -> fx.Node:
    copy = graph.node_copy(node, lambda n: env.get(n, n))
    _as_backward(copy)
    return copy


def _as_backward(node: fx.Node) -> None:
    """Marks a copy as the backward's (no longer one of the gathers to copy)."""
    node.meta["custom"] = {k: v for k, v in node.meta.get("custom", {}).items() if k != _MARK}
    mark_backward(node)


def _layout(root: fx.Node) -> tuple[list[fx.Node], fx.Node, list[fx.Node]] | None:
    """``(pieces, view, slices)`` of a coalesced gather (``core/_gather.py``'s
    ``gather_many``): the all-gather of ``cat(pieces)``, waited for and viewed as
    ``[ranks, -1]``, cut into one slice of dim 1 per piece, in order; None for any other."""
    cat = root.args[0]
    if not isinstance(cat, fx.Node) or cat.target is not _aten.cat.default or cat.args[1:]:
        return None
    pieces, waits = list(cat.args[0]), list(root.users)
    if len(waits) != 1 or waits[0].target is not _c10d.wait_tensor.default:
        return None
    views = list(waits[0].users)
    if len(views) != 1 or views[0].target is not _aten.view.default:
        return None
    view = views[0]
    if list(view.args[1]) != [root.args[1], -1] or not all(
        u.target is _aten.slice.Tensor and u.args[1] == 1 and len(u.args) == 4 for u in view.users
    ):
        return None
    slices = sorted(view.users, key=lambda s: s.args[2])
    start = 0
    for piece, cut in zip(pieces, slices, strict=False):
        if cut.args[2] != start or cut.args[3] - start != piece.meta["val"].numel():
            return None
        start = cut.args[3]
    return (pieces, view, slices) if len(pieces) == len(slices) else None


def _fewer(
    graph: fx.Graph, root: fx.Node, view: fx.Node, kept: list[fx.Node], inputs: list[fx.Node]
) -> dict[fx.Node, fx.Node]:
    """The all-gather of the ``inputs`` pieces only, waited for, viewed as ``[ranks, -1]``
    and cut into the slices that stand for ``kept``; ``{original slice: its new one}``."""
    cat = _new(graph, root, _aten.cat.default, (inputs,))
    gathered = _new(graph, root, root.target, (cat, *root.args[1:]), root.kwargs)
    waited = _new(graph, root, _c10d.wait_tensor.default, (gathered,))
    rows = _new(graph, view, view.target, (waited, view.args[1]))
    out, start = {}, 0
    for cut in kept:
        size = cut.args[3] - cut.args[2]
        out[cut] = _new(graph, cut, cut.target, (rows, 1, start, start + size))
        start += size
    return out


def _new(
    graph: fx.Graph,
    like: fx.Node,
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
) -> fx.Node:
    """A node calling ``target``, its value's metadata computed on the graph's fake tensors."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta = {k: v for k, v in like.meta.items() if k in ("stack_trace", "custom")}
    fake_args, fake_kwargs = fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    with like.meta["val"].fake_mode:
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    _as_backward(node)
    return node
