"""Batch leaves that hide tensors from d9d's pytrees: a dataclass, or a mapping or sequence of
a type optree does not flatten (``transformers``' ``BatchEncoding``, a ``UserDict``). Each is
one opaque leaf, so a split of the batch (microbatches, data-parallel shards, context-parallel
slices of the sequence) handed it whole to every part: under ``context_parallel`` every rank
took the whole sequence as its slice (a loss off one device's, no error), under microbatches
every microbatch ran the whole batch. The splitters refuse it instead."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["refuse_hidden_tensors"]

_DEPTH = 3  # containers looked into below the leaf; a batch nests its tensors shallowly


def refuse_hidden_tensors(name: str, leaf: Any, split: str) -> None:
    """Raise if ``leaf`` (not a tensor) holds a tensor that the pytree cannot reach.

    Args:
        name: The leaf and its path, for the message ("batch leaf 'inputs'").
        leaf: A leaf of that tree.
        split: What splits the tree ("2 microbatches"), for the message.

    Raises:
        TypeError: ``leaf`` is a dataclass, mapping or sequence holding a tensor.
    """
    if isinstance(leaf, (torch.Tensor, str, bytes, int, float, bool)) or leaf is None:
        return
    where = _tensor_inside(leaf, _DEPTH)
    if where is None:
        return
    raise TypeError(
        f"{name} ({type(leaf).__name__}) is one opaque leaf to d9d's pytrees (optree), and "
        f"it holds a tensor ({where}): splitting the batch into {split} "
        "would hand it whole to every part; pass its tensors in a dict, list, tuple or "
        "NamedTuple (dict(batch) for a mapping, a NamedTuple for a dataclass)"
    )


def _tensor_inside(value: Any, depth: int) -> str | None:
    """Where in ``value`` a tensor is (``"field 'x'"``), or None where none is found."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f"field {f.name!r}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, Mapping):
        items = [(f"key {k!r}", v) for k, v in value.items()]
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = [(f"item {i}", v) for i, v in enumerate(value)]
    else:
        return None
    for name, item in items:
        if isinstance(item, torch.Tensor):
            return name
        inner = _tensor_inside(item, depth - 1) if depth > 0 else None
        if inner is not None:
            return f"{name}, {inner}"
    return None
