"""Pytrees with string paths, on optree.

A d9d pytree is any nesting of dicts, lists, tuples and NamedTuples whose leaves are
tensors (a DTensor is one leaf), numbers or arbitrary objects. ``None`` is an empty
subtree, never a leaf, so a masked-out entry costs nothing. Params are flat dicts keyed
by module path, so the path of a param leaf is its key (``"layers.0.attn.wq.weight"``);
the path of an optimizer-state leaf is the dotted route to it (``"mu.layers.0.attn.wq.weight"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from optree import PyTreeSpec

__all__ = [
    "PyTreeSpec",
    "flatten",
    "flatten_with_paths",
    "leaves",
    "leaves_with_paths",
    "map",
    "map_with_path",
    "paths",
    "same_paths",
    "same_structure",
    "structure",
    "unflatten",
    "with_leaves",
]

_NONE_IS_LEAF = False


def _entry_name(entry: optree.PyTreeEntry) -> str:
    match entry:
        case optree.NamedTupleEntry() | optree.StructSequenceEntry() | optree.DataclassEntry():
            return str(entry.field)
        case optree.MappingEntry():
            return str(entry.key)
        case optree.SequenceEntry():
            return str(entry.index)
        case _:
            return str(entry.entry)


def _flat_keys(tree: Any) -> list[str] | None:
    """The sorted keys of a ``dict`` of tensors with string keys (params, grads, updates),
    which are its paths; None for any other tree.

    The shortcut is for Dynamo, which interprets optree's flattening bytecode by bytecode
    inside ``d9d.jit`` steps (500 to 1,500 bytecodes a leaf: an optimizer's layout check was a
    fifth of a small Llama's trace); eagerly optree is as quick.
    """
    if type(tree) is not dict:
        return None
    if not all(type(k) is str and isinstance(v, torch.Tensor) for k, v in tree.items()):
        return None
    return sorted(tree)


def _path_string(accessor: optree.PyTreeAccessor) -> str:
    return ".".join(_entry_name(entry) for entry in accessor)


def flatten(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """Leaves of ``tree`` in a fixed order (dict keys sorted) and its structure.

    Example:
        >>> leaves, spec = flatten({"b": 2, "a": 1})
        >>> leaves
        [1, 2]
    """
    return optree.tree_flatten(tree, none_is_leaf=_NONE_IS_LEAF)


def flatten_with_paths(tree: Any) -> tuple[list[tuple[str, Any]], PyTreeSpec]:
    """``(path, leaf)`` pairs of ``tree`` and its structure; paths are dotted strings.

    Example:
        >>> flatten_with_paths({"w": 1, "state": (2, 3)})[0]
        [('state.0', 2), ('state.1', 3), ('w', 1)]
    """
    accessors, leaves_, spec = optree.tree_flatten_with_accessor(tree, none_is_leaf=_NONE_IS_LEAF)
    return [(_path_string(a), leaf) for a, leaf in zip(accessors, leaves_, strict=True)], spec


def leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs of ``tree`` (:func:`flatten_with_paths` without the structure).

    Example:
        >>> leaves_with_paths({"w": 1, "state": (2, 3)})
        [('state.0', 2), ('state.1', 3), ('w', 1)]
    """
    keys = _flat_keys(tree)
    if keys is not None:
        return [(k, tree[k]) for k in keys]
    return flatten_with_paths(tree)[0]


def with_leaves(tree: Any, leaves_: list[Any]) -> Any:
    """A tree laid out like ``tree`` holding ``leaves_`` (in :func:`flatten` order):
    ``unflatten(structure(tree), leaves_)``.

    Example:
        >>> with_leaves({"b": 1, "a": 2}, [10, 20])
        {'b': 20, 'a': 10}
    """
    keys = _flat_keys(tree)
    if keys is None:
        return unflatten(structure(tree), leaves_)
    by_key = dict(zip(keys, leaves_, strict=True))  # ValueError on a count mismatch
    return {k: by_key[k] for k in tree}  # in the tree's own key order, as unflatten keeps


def unflatten(spec: PyTreeSpec, leaves_: list[Any]) -> Any:
    """The tree of structure ``spec`` holding ``leaves_`` (inverse of :func:`flatten`).

    Example:
        >>> leaves, spec = flatten({"a": 1, "b": 2})
        >>> unflatten(spec, [10, 20])
        {'a': 10, 'b': 20}
    """
    return optree.tree_unflatten(spec, leaves_)


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in :func:`flatten` order.

    Example:
        >>> leaves({"b": [2, 3], "a": 1})
        [1, 2, 3]
    """
    keys = _flat_keys(tree)
    if keys is not None:
        return [tree[k] for k in keys]
    return optree.tree_leaves(tree, none_is_leaf=_NONE_IS_LEAF)


def paths(tree: Any) -> list[str]:
    """The dotted path of every leaf of ``tree``, in :func:`flatten` order.

    Example:
        >>> paths({"mu": {"w": 0}, "count": 1})
        ['count', 'mu.w']
    """
    keys = _flat_keys(tree)
    if keys is not None:
        return keys
    return [path for path, _ in flatten_with_paths(tree)[0]]


def structure(tree: Any) -> PyTreeSpec:
    """The structure of ``tree`` (leaves replaced by placeholders).

    Example:
        >>> structure({"a": 1, "b": None})
        PyTreeSpec({'a': *, 'b': None})
    """
    return optree.tree_structure(tree, none_is_leaf=_NONE_IS_LEAF)


def same_structure(tree: Any, other: Any) -> bool:
    """Whether two trees have the same structure (keys, containers, leaf count).

    Example:
        >>> same_structure({"a": 1}, {"a": 2}), same_structure({"a": 1}, {"b": 1})
        (True, False)
    """
    return structure(tree) == structure(other)


def same_paths(tree: Any, other: Any) -> bool:
    """Whether two trees hold leaves at the same paths, in the same order.

    Paths are compared as optree's raw entries (dict key ``"0"`` differs from index ``0``), so
    equal paths line the leaves of both trees up one to one; container types are not compared
    (a list and a tuple of one leaf each have the same paths). Unlike
    :func:`same_structure`, Dynamo traces it on every supported torch: torch 2.11 cannot trace
    ``PyTreeSpec.__eq__`` ("Polyfill handler ... does not have a traceable function").

    Example:
        >>> same_paths({"a": 1, "b": None}, {"a": 2}), same_paths({"a": 1}, {"a": (1,)})
        (True, False)
    """
    keys, other_keys = _flat_keys(tree), _flat_keys(other)
    if keys is not None and other_keys is not None:
        return keys == other_keys
    return optree.tree_paths(tree, none_is_leaf=_NONE_IS_LEAF) == optree.tree_paths(
        other, none_is_leaf=_NONE_IS_LEAF
    )


def map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:  # noqa: A001 - mirrors jax.tree.map
    """Apply ``fn`` to every leaf of ``tree`` (and the matching leaves of ``rest``).

    Example:
        >>> map(lambda x, y: x + y, {"a": 1}, {"a": 2})
        {'a': 3}
    """
    return optree.tree_map(fn, tree, *rest, none_is_leaf=_NONE_IS_LEAF)


def map_with_path(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Apply ``fn(path, leaf, *rest_leaves)`` to every leaf; ``path`` is the dotted string.

    Example:
        >>> map_with_path(lambda p, x: f"{p}={x}", {"w": 1, "s": (2,)})
        {'w': 'w=1', 's': ('s.0=2',)}
    """
    pairs, spec = flatten_with_paths(tree)
    rest_leaves = [spec.flatten_up_to(other) for other in rest]
    mapped = [
        fn(path, leaf, *(other[i] for other in rest_leaves)) for i, (path, leaf) in enumerate(pairs)
    ]
    return unflatten(spec, mapped)
