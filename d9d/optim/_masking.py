"""``masked``: run a transformation on the leaves a mask selects; pass the others through.

The inner transformation sees the params and updates with every unselected leaf replaced
by ``None``, which ``d9d.tree`` treats as an empty subtree: its state holds nothing for
them (``mu={"ln.weight": None, "wq.weight": tensor}``) and its foreach ops skip them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from d9d import tree
from d9d.errors import OptimTreeMismatchError
from d9d.optim._offloaded import shown_to_masks
from d9d.optim._transform import GradientTransformation, check_state

__all__ = ["Mask", "MaskedState", "masked"]

Mask = str | Sequence[str] | Callable[[str, torch.Tensor], bool] | Any
"""A path regex, a list of them, a ``(path, param) -> bool`` callable, or a pytree of bools."""

_HOLE = object()


class MaskedState(NamedTuple):
    """State of ``masked``."""

    # The inner transformation's state, built from the params with unselected leaves as None.
    inner_state: Any


def _regex_selector(patterns: Sequence[str]) -> Callable[[str, torch.Tensor], bool]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as error:
            raise ValueError(f"mask has an invalid regex {pattern=}: {error}") from None
    return lambda path, _: any(regex.search(path) for regex in compiled)


def _pytree_selector(mask: Any) -> Callable[[Any], list[bool]]:
    flags = dict(tree.flatten_with_paths(mask)[0])
    wrong = {path: flag for path, flag in flags.items() if not isinstance(flag, bool)}
    if wrong:
        raise ValueError(
            f"a pytree mask must have bool leaves, got {wrong}; use True where the inner "
            "transformation applies and False elsewhere"
        )

    def select(params: Any) -> list[bool]:
        param_paths = tree.paths(params)
        # Leaves the params tree holds as None (masked out further out) may be absent or set.
        with_holes = optree.tree_map(lambda x: _HOLE if x is None else x, params, none_is_leaf=True)
        missing = sorted(set(param_paths) - flags.keys())
        unexpected = sorted(flags.keys() - set(tree.paths(with_holes)))
        if missing or unexpected:
            raise OptimTreeMismatchError(
                f"the mask pytree is not laid out like the params: {missing=} (param paths "
                f"with no flag), {unexpected=} (flags for paths that are not params); build "
                "it with d9d.tree.map_with_path(lambda path, p: ..., params)"
            )
        return [flags[path] for path in param_paths]

    return select


def _selector(mask: Mask) -> Callable[[Any], list[bool]]:
    """Turn any accepted mask into ``params -> [selected?]`` over ``tree.leaves(params)``."""
    match mask:
        case str():
            by_leaf = _regex_selector([mask])
        case list() | tuple() if all(isinstance(m, str) for m in mask):
            by_leaf = _regex_selector(mask)
        case _ if callable(mask):
            by_leaf = mask
        case _:
            return _pytree_selector(mask)

    def select(params: Any) -> list[bool]:
        flags = []
        for path, leaf in tree.flatten_with_paths(params)[0]:
            flag = by_leaf(path, shown_to_masks(path, leaf))
            if not isinstance(flag, bool):
                raise TypeError(
                    f"the mask callable returned {flag!r} for {path=}; it must return a Python "
                    "bool decided from the path, shape or dtype, never from tensor values"
                )
            flags.append(flag)
        return flags

    return select


def _keep(tree_: Any, flags: list[bool]) -> Any:
    leaves, spec = tree.flatten(tree_)
    return tree.unflatten(
        spec, [leaf if f else None for leaf, f in zip(leaves, flags, strict=True)]
    )


def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    """Apply ``inner`` only to the leaves ``mask`` selects; the other updates pass unchanged.

    ``mask`` is one of: a regex searched in each param path (``r"\\.weight$"``); a list of
    regexes (any match selects); a callable ``(path, param) -> bool``; or a pytree of bools
    laid out like the params. A regex selects; to exclude, use a negative look-ahead:
    ``r"^(?!.*(bias|norm))"`` selects every path without ``bias`` or ``norm``. The selection
    is made again at each ``update`` from the paths, shapes and dtypes (never values), from
    ``params`` or, when ``update`` gets none, from the updates.

    Args:
        inner: the transformation to restrict.
        mask: which leaves ``inner`` applies to, as above.

    Returns:
        A ``GradientTransformation`` with state ``MaskedState(inner_state)``; ``inner_state``
        holds ``None`` for every unselected param.

    Raises:
        ValueError: a regex does not compile, or a pytree mask has a non-bool leaf.
        OptimTreeMismatchError: a pytree mask is not laid out like the params (at ``init``).
        TypeError: a mask callable returns something other than a bool.

    Example:
        >>> import torch, d9d.optim as optim
        >>> opt = optim.masked(optim.scale(0.0), r"bias$")
        >>> params = {"b.bias": torch.ones(1), "b.weight": torch.ones(1)}
        >>> opt.update(params, opt.init(params), params)[0]
        {'b.bias': tensor([0.]), 'b.weight': tensor([1.])}
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"masked() takes a GradientTransformation as inner, got {inner!r}")
    select = _selector(mask)

    def init(params: Any) -> MaskedState:
        return MaskedState(inner_state=inner.init(_keep(params, select(params))))

    def update(updates: Any, state: MaskedState, params: Any = None) -> tuple[Any, Any]:
        check_state(state, MaskedState, "masked")
        flags = select(updates if params is None else params)
        inner_params = None if params is None else _keep(params, flags)
        inner_updates, inner_state = inner.update(
            _keep(updates, flags), state.inner_state, inner_params
        )
        leaves, spec = tree.flatten(updates)
        new_leaves = iter(tree.leaves(inner_updates))
        merged = [next(new_leaves) if f else leaf for leaf, f in zip(leaves, flags, strict=True)]
        return tree.unflatten(spec, merged), MaskedState(inner_state=inner_state)

    return GradientTransformation(init, update)
