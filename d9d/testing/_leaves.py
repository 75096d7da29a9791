"""Leaf pairing and conversion shared by the tree assertions.

Every assertion first lines two trees up path by path, then turns each leaf into a CPU
tensor it can compare: a DTensor is gathered with ``full_tensor()`` (a collective, so the
assertion must run on every rank of its mesh), a NumPy array is copied, a Python number
becomes a 0-d tensor. Other leaves (strings, dtypes, ...) stay as they are and are
compared with ``==``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from d9d import tree

__all__ = [
    "as_tensor",
    "describe",
    "format_value",
    "is_array",
    "listing",
    "paired_leaves",
    "unravel",
]

# Paths or leaves a message names before it says "... and N more".
_MAX_LISTED = 10


def listing(items: list[str], *, indent: str = "  ") -> str:
    """One item per line, at most ``_MAX_LISTED`` of them."""
    shown = [f"{indent}{item}" for item in items[:_MAX_LISTED]]
    if len(items) > _MAX_LISTED:
        shown.append(f"{indent}... and {len(items) - _MAX_LISTED} more")
    return "\n".join(shown)


def paired_leaves(actual: Any, expected: Any) -> list[tuple[str, Any, Any]]:
    """``(path, actual_leaf, expected_leaf)`` triples; raises if the structures differ."""
    actual_pairs, actual_spec = tree.flatten_with_paths(actual)
    expected_pairs, expected_spec = tree.flatten_with_paths(expected)
    if actual_spec == expected_spec:
        return [
            (path, a, e) for (path, a), (_, e) in zip(actual_pairs, expected_pairs, strict=True)
        ]
    actual_paths = {path for path, _ in actual_pairs}
    expected_paths = {path for path, _ in expected_pairs}
    missing = sorted(expected_paths - actual_paths)
    unexpected = sorted(actual_paths - expected_paths)
    if not missing and not unexpected:
        raise AssertionError(
            "Tree structures differ in their containers although the leaf paths are the same:\n"
            f"  actual:   {actual_spec}\n  expected: {expected_spec}"
        )
    parts = ["Tree structures differ."]
    if missing:
        parts.append(f"{len(missing)} missing path(s) (in expected, not in actual):")
        parts.append(listing([repr(p) for p in missing]))
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected path(s) (in actual, not in expected):")
        parts.append(listing([repr(p) for p in unexpected]))
    raise AssertionError("\n".join(parts))


def as_tensor(leaf: Any) -> torch.Tensor | None:
    """A detached CPU tensor holding ``leaf``'s values, or None for a non-numeric leaf."""
    match leaf:
        case DTensor():
            return leaf.full_tensor().detach().cpu()
        case torch.Tensor():
            if leaf.is_meta:
                raise TypeError(
                    "A meta tensor has no values to compare; materialise it first "
                    f"(got {leaf.shape=}, {leaf.dtype=})."
                )
            return leaf.detach().cpu()
        case np.ndarray() | np.generic():
            return torch.tensor(np.asarray(leaf))
        case bool() | int():
            return torch.tensor(leaf, dtype=torch.bool if isinstance(leaf, bool) else torch.int64)
        case float():
            return torch.tensor(leaf, dtype=torch.float64)
        case complex():
            return torch.tensor(leaf, dtype=torch.complex128)
        case _:
            return None


def is_array(leaf: Any) -> bool:
    """Whether ``leaf`` carries its own dtype (a tensor or a NumPy array)."""
    return isinstance(leaf, torch.Tensor | np.ndarray | np.generic)


def describe(leaf: Any) -> str:
    """A short description of a leaf's kind for type-mismatch messages."""
    if isinstance(leaf, torch.Tensor):
        return f"{type(leaf).__name__}(shape={tuple(leaf.shape)}, dtype={leaf.dtype})"
    if isinstance(leaf, np.ndarray | np.generic):
        return f"numpy {type(leaf).__name__}(shape={np.shape(leaf)}, dtype={leaf.dtype})"
    return f"{type(leaf).__name__} {leaf!r}"


def format_value(value: Any) -> str:
    """An element value, short but exact enough to tell two floats apart."""
    if isinstance(value, float) and math.isfinite(value):
        text = f"{value:.9g}"
        return text if any(c in text for c in ".e") else f"{text}.0"
    return repr(value)


def unravel(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    """The multi-dimensional index of element ``flat_index`` of a tensor of ``shape``."""
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), shape))
