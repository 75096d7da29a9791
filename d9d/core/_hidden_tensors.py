"""Batch leaves that hide tensors from d9d's pytrees: a dataclass, or a mapping or sequence of
a type optree does not flatten (``transformers``' ``BatchEncoding``, a ``UserDict``). Each is
one opaque leaf, so a split of the batch (microbatches, data-parallel shards, context-parallel
slices of the sequence) handed it whole to every part: under ``context_parallel`` every rank
took the whole sequence as its slice (a loss off one device's, no error), under microbatches
every microbatch ran the whole batch. The splitters refuse it instead."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["refuse_hidden_tensors"]

_DEPTH = 3  # containers looked into below the leaf; a batch nests its tensors shallowly
_BREADTH = 64  # items looked at per container: a batch holds few; a range may be long


def refuse_hidden_tensors(
    name: str, leaf: Any, split: str, *, min_ndim: int = 1, rows: int | None = None
) -> None:
    """Raise if ``leaf`` (not a tensor) holds a tensor that the pytree cannot reach and the
    split would have cut: of rank ``min_ndim`` or more and, where ``rows`` is given, of
    ``rows`` examples (dim 0). Others would go whole to every part as they do now: a
    ``d9d.Model`` (a dataclass holding its module) passed to the loss function beside the
    batch, metadata of 0-d tensors.

    Args:
        name: The leaf and its path, for the message ("batch leaf 'inputs'").
        leaf: A leaf of that tree.
        split: What splits the tree ("2 microbatches"), for the message.
        min_ndim: The least rank of a tensor the split cuts (1 along examples, 2 along the
            sequence).
        rows: The examples of the tensors the split cuts, None where it sees none.

    Raises:
        TypeError: ``leaf`` is a dataclass, mapping or sequence holding such a tensor.
    """
    if isinstance(leaf, (torch.Tensor, str, bytes, int, float, bool)) or leaf is None:
        return
    if _is_a_model(leaf):
        return

    def cut(tensor: torch.Tensor) -> bool:
        return tensor.ndim >= min_ndim and (rows is None or tensor.shape[0] == rows)

    where = _tensor_inside(leaf, _DEPTH, cut)
    if where is None:
        return
    raise TypeError(
        f"{name} ({type(leaf).__name__}) is one opaque leaf to d9d's pytrees (optree), and "
        f"it holds a tensor ({where}): splitting the batch into {split} "
        "would hand it whole to every part; pass its tensors in a dict, list, tuple or "
        "NamedTuple (dict(batch) for a mapping, a NamedTuple for a dataclass)"
    )


def _is_a_model(value: Any) -> bool:
    """A dataclass holding an ``nn.Module`` (``d9d.Model``, a teacher with its params): a
    model, passed whole to every part like a module, not data to split."""
    return (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and any(isinstance(getattr(value, f.name), nn.Module) for f in dataclasses.fields(value))
    )


def _tensor_inside(value: Any, depth: int, cut: Callable[[torch.Tensor], bool]) -> str | None:
    """Where in ``value`` a tensor that ``cut`` accepts is (``"field 'x'"``), or None."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f"field {f.name!r}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, Mapping):
        items = [(f"key {k!r}", v) for k, v in itertools.islice(value.items(), _BREADTH)]
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = [(f"item {i}", v) for i, v in enumerate(itertools.islice(value, _BREADTH))]
    else:
        return None
    for name, item in items:
        if isinstance(item, torch.Tensor):
            if cut(item):
                return name
            continue
        inner = _tensor_inside(item, depth - 1, cut) if depth > 0 else None
        if inner is not None:
            return f"{name}, {inner}"
    return None
