"""The optimizer interface: ``GradientTransformation``, ``chain`` and ``apply_updates``.

An optimizer is a pair of pure functions over pytrees laid out like the params (a flat
dict keyed by module path, leaves plain tensors or DTensors): ``init(params) -> state`` and
``update(updates, state, params=None) -> (updates, state)``. Neither mutates its inputs:
``update`` returns new update and state tensors, which may share storage with each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from d9d import tree
from d9d.core._gather import local_like
from d9d.errors import OptimTreeMismatchError

__all__ = [
    "STATE_FIX",
    "GradientTransformation",
    "apply_updates",
    "by_kind",
    "chain",
    "check_params",
    "check_same_layout",
    "check_state",
    "foreach_lerp",
    "zero_count",
]


class GradientTransformation(NamedTuple):
    """A pure optimizer: ``init(params) -> state`` and ``update(updates, state, params)``.

    ``update`` returns ``(updates, state)`` and mutates none of its inputs.

    Example:
        >>> import torch, d9d.optim as optim
        >>> opt = optim.sgd(0.1)
        >>> params = {"w": torch.ones(2)}
        >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.1000, -0.1000])
    """

    # init(params) -> state: the state for a params tree, all tensors.
    init: Callable[[Any], Any]
    # update(updates, state, params=None) -> (updates, state), pure.
    update: Callable[..., tuple[Any, Any]]


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations: each one's output updates are the next one's input.

    The state is a tuple with one entry per transformation, in order.

    Args:
        *transforms: the transformations, applied left to right.

    Returns:
        A ``GradientTransformation`` whose state is ``tuple(t.init(params) for t in transforms)``.

    Raises:
        TypeError: an argument is not a ``GradientTransformation``.

    Example:
        >>> import torch, d9d.optim as optim
        >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.scale(-0.5))
        >>> params = {"w": torch.zeros(2)}
        >>> opt.update({"w": torch.tensor([3.0, 4.0])}, opt.init(params))[0]["w"]
        tensor([-0.3000, -0.4000])
    """
    for position, transform in enumerate(transforms):
        if not isinstance(transform, GradientTransformation):
            raise TypeError(
                f"chain() takes GradientTransformations, got {transform!r} at {position=}; "
                "build one with a d9d.optim factory such as d9d.optim.scale_by_adam(...)"
            )

    def init(params: Any) -> tuple[Any, ...]:
        return tuple(transform.init(params) for transform in transforms)

    def update(updates: Any, state: tuple[Any, ...], params: Any = None) -> tuple[Any, Any]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            got = f"{len(state)} entries" if isinstance(state, tuple) else type(state).__name__
            raise OptimTreeMismatchError(
                f"chain of {len(transforms)} transformations got a state of {got} (another "
                "optimizer's state, or one restored without a target?); pass the one this "
                "optimizer's init returned (opt.init(params)), or the previous step's"
            )
        new_state = []
        for transform, inner_state in zip(transforms, state, strict=True):
            updates, inner_state = transform.update(updates, inner_state, params)
            new_state.append(inner_state)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


def apply_updates(params: Any, updates: Any) -> Any:
    """Return ``params + updates`` as a new tree; each result keeps its param's dtype.

    Runs one ``torch._foreach_add`` over the plain tensors and one over the DTensors. Each
    sum is computed in the wider of the param's and the update's dtype and rounded to the
    param's dtype once: a bfloat16 param plus a float32 update is ``(p.float() + u)`` rounded
    to nearest, not the update rounded to bfloat16 first (``stochastic_round`` relies on it).

    Args:
        params: the params pytree.
        updates: a pytree laid out like ``params`` (the output of ``update``).

    Returns:
        A new pytree laid out like ``params``; its leaves are new tensors.

    Raises:
        OptimTreeMismatchError: ``updates`` is not laid out like ``params``.
        TypeError: a param is not a floating or complex tensor (an integer leaf would be
            truncated back to an integer).

    Example:
        >>> import torch, d9d.optim as optim
        >>> optim.apply_updates({"w": torch.ones(2)}, {"w": torch.tensor([0.5, -1.0])})
        {'w': tensor([1.5000, 0.0000])}
    """
    check_same_layout(params, updates, what="updates")
    check_params(params, "apply_updates")
    param_leaves = tree.leaves(params)
    (sums,) = by_kind(
        lambda ps, us: (torch._foreach_add(ps, us),),
        param_leaves,
        tree.leaves(updates),
        outputs=1,
    )
    new_leaves = [
        s if s.dtype == p.dtype else s.to(p.dtype) for p, s in zip(param_leaves, sums, strict=True)
    ]
    return tree.with_leaves(params, new_leaves)


def by_kind(
    fn: Callable[..., tuple[Sequence[Any], ...]], *lists: Sequence[torch.Tensor], outputs: int
) -> tuple[list[Any], ...]:
    """Run ``fn`` on the plain tensors and on the DTensors apart; put the results back in order.

    A ``torch._foreach_*`` op refuses a list mixing plain tensors and DTensors, so leaf ``i``
    goes to the group of the kind of ``lists[0][i]``; DTensors on different meshes may share
    one call. ``fn(*lists)`` returns a tuple of ``outputs`` lists aligned with its inputs and
    shaped like them (elementwise ops, scalars from its closure); with a single kind of leaf
    (the usual case) it is called once, and with no leaves (everything masked out) not at all.

    When the DTensors at each position share one layout (mesh, placements, shape) and none is
    ``Partial``, ``fn`` runs on their local shards and the results are wrapped back: an
    elementwise op on equally placed shards is exactly its DTensor version, without DTensor's
    sharding propagation, whose cost grows about eightfold per mesh dimension (eager only).

    ``fn`` sees a 0-d plain tensor as one element of shape ``(1,)`` (its results are shaped
    back): the 0-d float64 and float32 scalars the primitives scale by (bias corrections,
    the learning rate, the clipping factor) would otherwise promote a 0-d leaf, whose
    updates came out float64 (a float32 scalar param under Adam) or float32 (a bfloat16
    one), computed unlike every other leaf.
    """
    fn = _zero_d_as_one_element(fn)
    first = lists[0]
    groups = [
        [i for i, leaf in enumerate(first) if isinstance(leaf, DTensor) is is_dtensor]
        for is_dtensor in (False, True)
    ]
    groups = [group for group in groups if group]
    if len(groups) == 1:
        return _on_shards_if_aligned(fn, lists)
    merged: tuple[list[Any], ...] = tuple([None] * len(first) for _ in range(outputs))
    for group in groups:
        results = _on_shards_if_aligned(fn, [[values[i] for i in group] for values in lists])
        for out, result in zip(merged, results, strict=True):
            for i, value in zip(group, result, strict=True):
                out[i] = value
    return merged


def _zero_d_as_one_element(
    fn: Callable[..., tuple[Sequence[Any], ...]],
) -> Callable[..., tuple[list[Any], ...]]:
    """``fn`` with 0-d plain tensors passed in as shape ``(1,)`` views and shaped back out."""

    def wrapped(*lists: Sequence[Any]) -> tuple[list[Any], ...]:
        first = lists[0]
        zero_d = [not isinstance(x, DTensor) and x.ndim == 0 for x in first]
        if not any(zero_d):
            return tuple(list(result) for result in fn(*lists))
        widened = [
            [x.reshape(1) if flat else x for x, flat in zip(values, zero_d, strict=True)]
            for values in lists
        ]
        return tuple(
            [x.reshape(()) if flat else x for x, flat in zip(result, zero_d, strict=True)]
            for result in fn(*widened)
        )

    return wrapped


def foreach_lerp(starts: Sequence[Any], ends: Sequence[Any], weight: float) -> list[Any]:
    """``torch._foreach_lerp(starts, ends, weight)``, with DTensors one ``torch.lerp`` each.

    DTensors reach here while Dynamo traces a step, or when their layouts differ (see
    :func:`by_kind`). torch 2.11's DTensor has no sharding strategy for ``_foreach_lerp``
    ("Operator aten._foreach_lerp.Scalar does not have a sharding strategy registered"), and
    its in-place ``_foreach_lerp_`` compiles to results 1 ulp off eager there; ``torch.lerp``
    is exact and sharded on every supported torch, and a compiled graph fuses it anyway.
    """
    if starts and isinstance(starts[0], DTensor):
        return [torch.lerp(start, end, weight) for start, end in zip(starts, ends, strict=True)]
    return torch._foreach_lerp(starts, ends, weight)


def _on_shards_if_aligned(
    fn: Callable[..., tuple[Sequence[Any], ...]], lists: Sequence[Sequence[Any]]
) -> tuple[list[Any], ...]:
    """``fn(*lists)``, on local shards when every position's DTensors share one layout."""
    first = lists[0]
    # Not while Dynamo traces: comparing placements there guards on the identity of the
    # placement objects, which differ between calls; a compiled graph propagates once anyway.
    if (
        torch.compiler.is_compiling()
        or not first
        or not all(_aligned(values, first) for values in lists)
    ):
        return tuple(list(result) for result in fn(*lists))
    results = fn(*([leaf.to_local() for leaf in values] for values in lists))
    return tuple(
        [local_like(local, like) for local, like in zip(result, first, strict=True)]
        for result in results
    )


def _aligned(values: Sequence[Any], first: Sequence[Any]) -> bool:
    return all(
        isinstance(leaf, DTensor)
        and leaf.device_mesh == like.device_mesh
        and leaf.placements == like.placements
        and leaf.shape == like.shape
        and not any(p.is_partial() for p in leaf.placements)
        for leaf, like in zip(values, first, strict=True)
    )


def zero_count(params: Any) -> torch.Tensor:
    """A 0-d int64 zero on the device of the first param (CPU for an empty tree).

    Counters are tensors, not Python ints, so a compiled step sees the same graph inputs
    at every step and never recompiles as the count advances.
    """
    leaves = tree.leaves(params)
    device = leaves[0].device if leaves else torch.device("cpu")
    return torch.zeros((), dtype=torch.int64, device=device)


def check_params(params: Any, owner: str, *, complex_ok: bool = True) -> None:
    """Raise ``TypeError`` unless every leaf of ``params`` is a floating tensor (or a complex
    one, where ``complex_ok``), naming the first other leaf's path and dtype.

    An integer or bool leaf has no gradient to follow: Adam failed inside ``torch.lerp``
    (``"lerp_kernel_scalar" not implemented for 'Long'``) and SGD's float update was
    truncated back to the integer by ``apply_updates`` (3 - 0.03 became 2).
    """

    def accepted(leaf: Any) -> bool:
        return isinstance(leaf, torch.Tensor) and (
            leaf.is_floating_point() or (complex_ok and leaf.is_complex())
        )

    if all(accepted(leaf) for leaf in tree.leaves(params)):  # once a step: paths only on error
        return
    for path, leaf in tree.flatten_with_paths(params)[0]:
        if accepted(leaf):
            continue
        kind = f"dtype {leaf.dtype}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
        allowed = "floating or complex" if complex_ok else "floating"
        raise TypeError(
            f"{owner} takes params of {allowed} tensors, got leaf {path!r} of {kind}; "
            "leave it out of the params tree (or set it to None) and keep it beside them"
        )


STATE_FIX = "pass the state opt.init(params) returned for these params, or the previous step's"
"""The advice that ends the message of a per-param state laid out unlike the grads."""


def check_state(state: Any, kind: type, owner: str) -> None:
    """Raise ``OptimTreeMismatchError`` unless ``state`` is a ``kind``, the state ``owner``'s
    init returns (another optimizer's state failed on its fields: ``tuple.count + 1``)."""
    if not isinstance(state, kind):
        raise OptimTreeMismatchError(
            f"{owner}'s update got a state of type {type(state).__name__}, not its own "
            f"{kind.__name__} (another optimizer's state, or one restored without a "
            "target?); pass the one this optimizer's init returned (opt.init(params)), or the "
            "previous step's"
        )


def check_same_layout(params: Any, other: Any, *, what: str, fix: str | None = None) -> None:
    """Raise ``OptimTreeMismatchError`` unless ``other`` is laid out like ``params``.

    Laid out alike means leaves at the same paths in the same order (:func:`d9d.tree.same_paths`),
    which is what lines each update up with its param. Paths rather than ``PyTreeSpec``
    equality: this check runs inside ``d9d.jit`` steps, and torch 2.11's Dynamo cannot trace a
    spec comparison, so ``same_structure`` here failed every jitted step there. ``fix``
    replaces the advice that ends the message.
    """
    if tree.same_paths(params, other):
        return
    param_paths, other_paths = set(tree.paths(params)), set(tree.paths(other))
    missing = sorted(param_paths - other_paths)
    unexpected = sorted(other_paths - param_paths)
    pairs = zip(tree.paths(params), tree.paths(other), strict=False)
    moved = [(i, a, b) for i, (a, b) in enumerate(pairs) if a != b]
    if not missing and not unexpected and moved:
        index, ours, theirs = moved[0]
        raise OptimTreeMismatchError(
            f"the {what} tree has the params' paths in another order (an OrderedDict built in "
            f"another order than the params'): leaf {index} is {ours!r} in the params, "
            f"{theirs!r} in the {what}; "
            + (
                fix
                or "build it from the params, e.g. d9d.tree.map(fn, params), so each leaf "
                "lines up with its param"
            )
        )
    raise OptimTreeMismatchError(
        f"the {what} tree is not laid out like the params: {missing=} (params paths it lacks), "
        f"{unexpected=} (paths that are not params); "
        + (
            fix
            or "build it from the params, e.g. d9d.tree.map(fn, params), so the keys and "
            "containers match"
        )
    )
