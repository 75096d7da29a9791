"""Assertions over one pytree: every value finite, every leaf of the expected shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree
import torch

from d9d.tree import flatten_with_paths

from ._leaves import as_tensor, describe, listing, paired_leaves, unravel

__all__ = ["assert_tree_all_finite", "assert_tree_shapes"]


def _non_finite(t: torch.Tensor) -> str | None:
    """How many NaN and infinite elements ``t`` holds and where the first is, or None."""
    if not (t.is_floating_point() or t.is_complex()):
        return None
    bad = ~t.isfinite()
    if not bad.any():
        return None
    nan = int(t.isnan().sum())
    counts = [f"{nan} NaN"] if nan else []
    if t.is_complex():
        counts.append(f"{int(bad.sum()) - nan} Inf")
    else:
        counts.extend(
            f"{n} {sign}Inf"
            for sign, n in (("+", int((t == np.inf).sum())), ("-", int((t == -np.inf).sum())))
            if n
        )
    first = unravel(int(bad.reshape(-1).to(torch.uint8).argmax()), t.shape)
    return f"{', '.join(counts)} of {t.numel()} elements; first at index {first}"


def assert_tree_all_finite(tree: Any) -> None:
    """Assert no leaf of a pytree holds NaN or infinity.

    Floating and complex tensors, NumPy arrays and Python floats are checked; integer,
    bool and non-numeric leaves are finite by definition. A DTensor is checked through
    ``full_tensor()``, which gathers it, so every rank sees the same answer: call this on
    every rank of its mesh.

    Args:
        tree: The pytree to check.

    Raises:
        AssertionError: Some leaf holds NaN or infinity. The message names each such path
            with its NaN, +Inf and -Inf counts and the index of the first bad element.

    Example:
        >>> import torch
        >>> assert_tree_all_finite({"loss": torch.tensor(2.5), "step": 3})
    """
    pairs, _ = flatten_with_paths(tree)
    problems = []
    for path, leaf in pairs:
        t = as_tensor(leaf)
        found = None if t is None else _non_finite(t)
        if found is not None:
            problems.append(f"{path!r}: {found}")
    if problems:
        raise AssertionError(
            f"{len(problems)} of {len(pairs)} leaves hold non-finite values:\n{listing(problems)}"
        )


@dataclass(frozen=True)
class _Shape:
    """An expected shape, wrapped so that tree flattening stops at it."""

    dims: Any


def _is_shape(value: Any) -> bool:
    return isinstance(value, tuple) and all(
        isinstance(d, int) and not isinstance(d, bool) for d in value
    )


def _checked_shape(value: Any, path: str, source: str) -> tuple[int, ...]:
    if not _is_shape(value):
        raise TypeError(
            f"The expected shape for {path!r} from {source} is {value!r}; give each shape "
            "as a tuple of ints, e.g. (4, 8), or () for a scalar."
        )
    return tuple(value)


def _leaf_shape(leaf: Any) -> tuple[int, ...] | None:
    if isinstance(leaf, torch.Tensor | np.ndarray | np.generic):
        return tuple(leaf.shape)  # a DTensor's shape is its global shape: no gather
    if isinstance(leaf, bool | int | float | complex):
        return ()
    return None


def assert_tree_shapes(tree: Any, shapes: Any | Callable[[str], tuple[int, ...]]) -> None:
    """Assert every leaf of a pytree has the expected shape.

    ``shapes`` is either a tree of the same structure holding a tuple of ints (or a
    ``torch.Size``) where ``tree`` holds a leaf, or a function from a leaf's dotted path to
    its expected shape. A DTensor is checked by its global shape, without communication.
    Python numbers have shape ``()``.

    Args:
        tree: The pytree to check.
        shapes: The expected shapes, as a tree of tuples or as ``fn(path) -> tuple``.

    Raises:
        AssertionError: The trees' paths differ (missing and unexpected paths are listed), or
            some leaves have other shapes (each path is named with both shapes).
        TypeError: An expected shape is not a tuple of ints.

    Example:
        >>> import torch
        >>> assert_tree_shapes({"w": torch.zeros(4, 8)}, {"w": (4, 8)})
        >>> assert_tree_shapes({"w": torch.zeros(4, 8)}, lambda path: (4, 8))
    """
    if callable(shapes):
        pairs, _ = flatten_with_paths(tree)
        triples = [
            (path, leaf, _checked_shape(shapes(path), path, "the shapes function"))
            for path, leaf in pairs
        ]
    else:
        wrapped = optree.tree_map(_Shape, shapes, is_leaf=_is_shape, none_is_leaf=False)
        for path, want in flatten_with_paths(wrapped)[0]:
            _checked_shape(want.dims, path, "the shapes tree")
        triples = [
            (path, leaf, tuple(want.dims)) for path, leaf, want in paired_leaves(tree, wrapped)
        ]
    problems = []
    for path, leaf, want in triples:
        shape = _leaf_shape(leaf)
        if shape is None:
            problems.append(f"{path!r}: {describe(leaf)} has no shape, expected {want}")
        elif shape != want:
            problems.append(f"{path!r}: shape {shape}, expected {want}")
    if problems:
        raise AssertionError(
            f"{len(problems)} of {len(triples)} leaves have unexpected shapes:\n{listing(problems)}"
        )
