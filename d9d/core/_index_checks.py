"""Integer inputs checked against the table they index, inside a compiled step.

Inductor turns an out-of-range index into a C++ ``TORCH_CHECK`` inside an OpenMP region, which
aborts the process instead of raising (on CUDA, a device-side assert, sticky for the process).
Before a captured graph is compiled, every lookup into a table (``F.embedding``, ``gather``)
whose index is computed from the step's integer inputs alone (token ids, labels) gets that index
passed through ``d9d::check_index``: an opaque op that raises :class:`~d9d.errors.IndexRangeError`,
naming the step inputs the index comes from, before the lookup runs. Donated inputs are then
still untouched: their copies come at the graph's end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import fx
from torch.distributed.tensor import DTensor

from ..errors import IndexRangeError

__all__ = ["check_index", "guard_indices", "raise_outside", "source_name"]

_STEP_ARGS = ("params", "opt_state", "batch")


@torch.library.custom_op("d9d::check_index", mutates_args=())
def check_index(index: torch.Tensor, size: int, what: str) -> torch.Tensor:
    """A copy of ``index``, after raising unless its values lie in ``[0, size)``.

    One reduction and one device-to-host read per call.
    """
    raise_outside(index, size, what)
    return index.clone()


def raise_outside(index: torch.Tensor, size: int, what: str, first_row: int = 0) -> None:
    """Raise :class:`~d9d.errors.IndexRangeError` unless ``index`` lies in ``[0, size)``; one
    reduction (``aminmax``) and one device-to-host read (a sync on an accelerator). Positions
    are named as in a tensor whose rows ``index`` holds from ``first_row`` on."""
    if not index.numel():
        return
    low, high = torch.stack(torch.aminmax(index)).tolist()
    if low >= 0 and high < size:
        return
    outside = (index < 0) | (index >= size)
    at = tuple(outside.nonzero()[0].tolist())
    value = index[at].item()
    if at:
        at = (at[0] + first_row, *at[1:])
    raise IndexRangeError(
        f"{what} holds {value} at position {at}, outside [0, {size}); check "
        "the data against the model (token ids from a tokenizer whose vocab is larger than "
        "the model's vocab_size, or labels that are neither class ids nor the ignore index)"
    )


@check_index.register_fake
def _(index: torch.Tensor, size: int, what: str) -> torch.Tensor:
    return torch.empty_like(index)


_Lookup = tuple[object, object, int, str]
"""A lookup's index node, table node, the table dim it indexes, and what it is."""


def _embedding(node: fx.Node) -> _Lookup:
    args = dict(zip(("input", "weight"), node.args, strict=False)) | node.kwargs
    return args.get("input"), args.get("weight"), 0, "an embedding"


def _gather(node: fx.Node) -> _Lookup | None:
    args = dict(zip(("input", "dim", "index"), node.args, strict=False)) | node.kwargs
    dim = args.get("dim")
    return (args.get("index"), args.get("input"), dim, "a gather") if isinstance(dim, int) else None


_LOOKUPS: dict[tuple[str, object], Callable[[fx.Node], _Lookup | None]] = {
    ("call_function", F.embedding): _embedding,
    ("call_function", torch.gather): _gather,
    ("call_method", "gather"): _gather,
}


def guard_indices(graph: fx.GraphModule) -> int:
    """Route each integer index of a table lookup in ``graph`` (a Dynamo capture) through
    ``d9d::check_index``; returns how many lookups were guarded.

    A check the step made itself (``tensor_parallel``'s vocab-parallel embedding checks the
    global ids before it masks them) gets the names of the step inputs its index comes from,
    and the lookups after it are not checked again.
    """
    guarded = 0
    for node in list(graph.graph.nodes):
        if _is_check(node):
            index, size, what = node.args
            inputs = _inputs_of(index)
            if inputs:
                node.args = (index, size, f"{' and '.join(inputs)}, {what}")
                guarded += 1
            continue
        rule = _LOOKUPS.get((node.op, node.target))
        found = rule(node) if rule is not None else None
        if found is None:
            continue
        index, table, dim, kind = found
        index_value, table_value = _value(index), _value(table)
        if not _plain_integer(index_value) or not isinstance(table_value, torch.Tensor):
            continue
        inputs = _inputs_of(index)
        if not inputs:
            continue
        size = table_value.shape[dim]
        what = f"{' and '.join(inputs)}, the index of {kind} over {size} entries,"
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


def _is_check(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (
        torch.ops.d9d.check_index,
        torch.ops.d9d.check_index.default,
    )


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


def _inputs_of(index: fx.Node) -> list[str]:
    """The step inputs ``index`` is computed from, named like ``batch['tokens']``; none when
    any tensor on the way is floating (an index the model computes, like a router's top-k,
    is in range by construction and is left unguarded: each guard is a device-to-host read),
    and none when the index went through a check already."""
    names, seen, stack = set(), set(), [index]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _is_check(node):
            return []
        value = _value(node)
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            return []
        if node.op == "placeholder":
            names.add(source_name(node))
        stack.extend(node.all_input_nodes)
    return sorted(names)


def source_name(placeholder: fx.Node) -> str:
    """The step input a Dynamo graph's placeholder holds, named like ``batch['tokens']``."""
    grapharg = placeholder.meta.get("grapharg")
    name = grapharg.source.name if grapharg is not None else placeholder.name
    for i, arg in enumerate(_STEP_ARGS):
        prefix = f"L['args'][{i}]"
        if name.startswith(prefix):
            return arg + name[len(prefix) :]
    return name
