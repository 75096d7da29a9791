"""Integer inputs checked against the table they index, inside a compiled step.

Inductor turns an out-of-range index into a C++ ``TORCH_CHECK`` inside an OpenMP region (or a
CUDA device assert), which aborts the process instead of raising. Before a captured graph is
compiled, every lookup of a plain integer tensor into a table (``F.embedding``, ``gather``) gets
its index passed through ``d9d::check_index``: an opaque op that raises
:class:`~d9d.errors.IndexRangeError`, naming the step input the index comes from, before the
lookup runs. Donated inputs are then still untouched: their copies come at the graph's end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import fx
from torch.distributed.tensor import DTensor

from .errors import IndexRangeError

__all__ = ["check_index", "guard_indices"]

_STEP_ARGS = ("params", "opt_state", "batch")


@torch.library.custom_op("d9d::check_index", mutates_args=())
def check_index(index: torch.Tensor, size: int, what: str) -> torch.Tensor:
    """A copy of ``index``, after raising unless its values lie in ``[0, size)``.

    One reduction and one device-to-host read per call.
    """
    outside = (index < 0) | (index >= size)
    if outside.any():
        at = tuple(outside.nonzero()[0].tolist())
        raise IndexRangeError(
            f"{what} holds {index[at].item()} at position {at}, outside [0, {size}); check "
            "the data against the model (token ids from a tokenizer whose vocab is larger than "
            "the model's vocab_size, or labels that are neither class ids nor the ignore index)"
        )
    return index.clone()


@check_index.register_fake
def _(index: torch.Tensor, size: int, what: str) -> torch.Tensor:
    return torch.empty_like(index)


def _embedding(node: fx.Node) -> tuple[fx.Node, fx.Node, int, str] | None:
    index, weight = (
        node.args[0],
        node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None),
    )
    return (index, weight, 0, "an embedding") if isinstance(weight, fx.Node) else None


def _gather(node: fx.Node) -> tuple[fx.Node, fx.Node, int, str] | None:
    source, dim, index = (*node.args, None, None)[:3]
    dim = node.kwargs.get("dim", dim)
    index = node.kwargs.get("index", index)
    return (index, source, dim, "a gather") if isinstance(dim, int) else None


_LOOKUPS: dict[
    tuple[str, object], Callable[[fx.Node], tuple[fx.Node, fx.Node, int, str] | None]
] = {
    ("call_function", F.embedding): _embedding,
    ("call_function", torch.gather): _gather,
    ("call_method", "gather"): _gather,
}


def guard_indices(graph: fx.GraphModule) -> int:
    """Route each integer index of a table lookup in ``graph`` (a Dynamo capture) through
    ``d9d::check_index``; returns how many lookups were guarded."""
    guarded = 0
    for node in list(graph.graph.nodes):
        rule = _LOOKUPS.get((node.op, node.target))
        found = rule(node) if rule is not None else None
        if found is None:
            continue
        index, table, dim, kind = found
        index_value = _value(index)
        table_value = _value(table)
        if not _plain_integer(index_value) or not isinstance(table_value, torch.Tensor):
            continue
        size = table_value.shape[dim]
        what = f"{_origin(index)}, the index of {kind} over {size} entries,"
        with graph.graph.inserting_before(node):
            checked = graph.graph.call_function(
                torch.ops.d9d.check_index.default, (index, size, what)
            )
        checked.meta["example_value"] = index_value
        node.replace_input_with(index, checked)
        guarded += 1
    if guarded:
        graph.recompile()
    return guarded


def _value(node: object) -> object:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _plain_integer(value: object) -> bool:
    """An integer tensor that is not a DTensor (a sharded lookup masks its own indices)."""
    return (
        isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and not value.is_floating_point()
        and not value.is_complex()
        and value.dtype != torch.bool
    )


def _origin(node: fx.Node) -> str:
    """The step inputs ``node`` is computed from, named like ``batch['tokens']``."""
    names, seen, stack = [], set(), [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            if _plain_integer(_value(current)):
                names.append(_source_name(current))
            continue
        stack.extend(current.all_input_nodes)
    return " and ".join(sorted(set(names))) or "an integer tensor computed in the step"


def _source_name(placeholder: fx.Node) -> str:
    grapharg = placeholder.meta.get("grapharg")
    name = grapharg.source.name if grapharg is not None else placeholder.name
    for i, arg in enumerate(_STEP_ARGS):
        prefix = f"L['args'][{i}]"
        if name.startswith(prefix):
            return arg + name[len(prefix) :]
    return name
