"""What ``d9d.jit`` donates: each donated leaf overwritten in place with its new value, the old
trees marked, and the checks that keep that the same as the eager step (no two donated leaves
on one buffer, no new value or output read from a buffer the copies overwrite)."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import tree
from ..errors import DonatedTreeError
from ._index_checks import source_name

__all__ = [
    "alias_and_mark",
    "check_copies_apart",
    "check_like",
    "check_new_leaves_apart",
    "check_not_donated",
    "check_outputs_apart",
    "copy_into",
    "donated_memory",
]

_DONATED = "_d9d_donated_at_call"


def check_like(old: Any, new: Any, *, argnum: int) -> None:
    """Refuse a new donated tree not laid out like the old one (its structure, containers
    too), leaf shapes and dtypes too.

    Raises:
        TypeError: Another structure, or a leaf of another shape or dtype.
    """
    if torch.compiler.is_compiling():
        # Dynamo runs tree.map natively, while it interprets optree's flattening with paths
        # bytecode by bytecode (about 80,000 for the tiny Llama's AdamW state, a third of the
        # step's trace). What this refuses the eager check below refuses too: a refusal here
        # runs the frame eagerly, where the message names the leaf.
        tree.map(_refuse_unlike, old, new)
        return
    # No PyTreeSpec equality: Dynamo compiles the frames an eagerly run frame calls, and torch
    # 2.11's cannot trace it. tree.map raises where containers or keys differ; paths differ
    # where a leaf became a subtree.
    try:
        tree.map(_old, old, new)
        like = tree.same_paths(old, new)
    except ValueError:
        like = False
    if not like:
        old_paths, new_paths = set(tree.paths(old)), set(tree.paths(new))
        missing, unexpected = sorted(old_paths - new_paths), sorted(new_paths - old_paths)
        found = (
            f"{missing=} (paths the returned tree lacks), {unexpected=} (paths it adds)"
            if missing or unexpected
            else f"its containers differ ({tree.structure(new)} for {tree.structure(old)})"
        )
        raise TypeError(
            f"donated argument {argnum} is not laid out like the tree the step returned in its "
            f"place: {found}; return a tree of the same structure"
        )
    for (path, a), b in zip(tree.flatten_with_paths(old)[0], tree.leaves(new), strict=True):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            raise TypeError(
                f"donated argument {argnum} leaf {path!r} is not a tensor but a "
                f"{type(a).__name__} (the step returned a {type(b).__name__}); jit writes each "
                "donated leaf's new value into its tensor: hold the value in a tensor "
                "(torch.tensor(...)), or build the jit with donate=()"
            )
        if a.shape != b.shape or a.dtype != b.dtype:
            raise TypeError(
                f"donated argument {argnum} leaf {path!r} is {a.dtype}{list(a.shape)} but the "
                f"step returned {b.dtype}{list(b.shape)}; a donated leaf keeps its shape and dtype"
            )


def _old(old: Any, new: Any) -> Any:
    """``old``: a leaf, never None, where ``new`` may be (a None where ``old`` has a leaf).
    Dynamo compiles this map as a frame of its own when ``check_like`` runs eagerly, and its
    optree polyfill unflattens a None as an empty subtree ("length mismatch")."""
    del new
    return old


def _refuse_unlike(old: Any, new: Any) -> Any:
    """Raise where :func:`check_like` would, without the leaf's path (traced); else ``new``."""
    if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor):
        raise TypeError("a donated leaf is not a tensor")
    if old.shape != new.shape or old.dtype != new.dtype:
        raise TypeError("a donated leaf changed its shape or dtype")
    return new


def copy_into(old: Any, new: Any) -> None:
    """Each leaf of ``new`` copied into the matching leaf of ``old`` (checked alike first)."""
    # One copy_ per leaf, not torch._foreach_copy_: inductor (torch 2.13) lets a later output
    # read an input that _foreach_copy_ already overwrote (docs/decisions.md has the repro).
    # tree.map, not a loop over tree.leaves: Dynamo runs it natively (check_like).
    tree.map(torch.Tensor.copy_, old, new)


def check_not_donated(arg: Any, *, name: str) -> None:
    """Refuse a tree holding a leaf donated to an earlier jitted call: its buffer holds that
    call's new values, so reading it as the old tree (a checkpoint of the previous step, an
    EMA, a comparison, another step) is silently wrong. JAX raises on a deleted array;
    PyTorch cannot free a buffer under a live tensor, so d9d checks at its entry points.

    Args:
        arg: The tree to check.
        name: What the tree is, for the message (``"argument 0"``, ``"the tree to save"``).

    Raises:
        DonatedTreeError: A leaf of ``arg`` was donated.
    """
    if not any(hasattr(leaf, _DONATED) for leaf in tree.leaves(arg)):
        return
    for path, leaf in tree.flatten_with_paths(arg)[0]:
        call = getattr(leaf, _DONATED, None)
        if call is not None:
            raise DonatedTreeError(
                f"{name} leaf {path!r} was donated to call {call} of a jitted step and its "
                "buffer now holds that call's new values; use the tree that call returned, "
                "or a copy (.clone()) taken before the call"
            )


# Per device, the donated leaves' byte spans, sorted and apart: the first address of each,
# one past the last of each, and each leaf's (argument, leaf index).
_Spans = dict[torch.device, tuple[list[int], list[int], list[tuple[int, int]]]]


def _local(leaf: Any) -> torch.Tensor | None:
    """The tensor holding ``leaf``'s elements (a DTensor's local tensor); None for a leaf that
    is not a plain tensor or holds no memory."""
    local = leaf._local_tensor if isinstance(leaf, DTensor) else leaf
    if type(local) not in (torch.Tensor, torch.nn.Parameter) or local.is_meta:
        return None
    return local if local.numel() else None


def _bytes(local: torch.Tensor) -> tuple[int, int]:
    """The first byte of its buffer ``local`` reads and one past its last."""
    start = local.storage_offset()
    end = start + 1 + sum((n - 1) * s for n, s in zip(local.shape, local.stride(), strict=True))
    return start * local.element_size(), end * local.element_size()


def _span(local: torch.Tensor) -> tuple[int, int]:
    """:func:`_bytes` as addresses. Not per storage: two storages may hold one memory
    (``torch.from_numpy`` of two overlapping views of one array), and a leaf written into one
    overwrote the other's elements with no error."""
    base = local.untyped_storage().data_ptr()
    start, end = _bytes(local)
    return base + start, base + end


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors on one buffer read some byte in common (spans, not elements: two
    interleaved views count as overlapping)."""
    (a_start, a_end), (b_start, b_end) = _bytes(a), _bytes(b)
    return a_start < b_end and b_start < a_end


def _leaf_name(arg: Any, index: int, *, kind: str, argnum: int) -> str:
    return f"{kind} {argnum} leaf {tree.flatten_with_paths(arg)[0][index][0]!r}"


def donated_memory(args: Sequence[Any], donate: Sequence[int]) -> _Spans:
    """The memory of the donated leaves, after checking that no two leaves overlap: each is
    overwritten with its own new value, so one would overwrite the other's (the same tensor
    twice, or a view of another, gave both the last value written).

    Raises:
        DonatedTreeError: Two donated leaves share memory.
    """
    by_device: dict[torch.device, list[tuple[int, int, int, int]]] = {}
    for i in donate:
        for index, leaf in enumerate(tree.leaves(args[i])):  # paths only for the message
            local = _local(leaf)
            if local is not None:
                by_device.setdefault(local.device, []).append((*_span(local), i, index))
    spans: _Spans = {}
    for device, held in by_device.items():
        held.sort()  # by start: two that overlap make some neighbours overlap
        for before, span in itertools.pairwise(held):
            if span[0] < before[1]:
                first, second = (
                    _leaf_name(args[i], index, kind="argument", argnum=i)
                    for _, _, i, index in (before, span)
                )
                raise DonatedTreeError(
                    f"{first} and {second} share memory (one tensor passed twice, or a "
                    "view of another); jit writes each donated leaf's new value into its "
                    "own buffer, so one would overwrite the other: pass separate tensors "
                    "(clone one of them), or build the jit with donate=()"
                )
        spans[device] = ([h[0] for h in held], [h[1] for h in held], [(h[2], h[3]) for h in held])
    return spans


def _donated_under(donated: _Spans, leaf: Any) -> list[tuple[int, int]]:
    """(argument, leaf index) of each donated leaf sharing a byte with ``leaf``."""
    local = _local(leaf)
    if local is None or local.device not in donated:
        return []
    starts, ends, leaves = donated[local.device]
    start, end = _span(local)
    # The spans are apart and sorted by start, so their ends are sorted too.
    return leaves[bisect.bisect_right(ends, start) : bisect.bisect_left(starts, end)]


def check_outputs_apart(
    args: Sequence[Any], results: Sequence[Any], donated: _Spans, donate: Sequence[int]
) -> None:
    """Refuse an output (not donated) that shares memory with a donated leaf: the call has
    overwritten that leaf with its new value, where the eager step returns the old one.

    Raises:
        DonatedTreeError: An output leaf shares memory with a donated argument's leaf.
    """
    for k, out in enumerate(results):
        if k in donate:
            continue
        for index, leaf in enumerate(tree.leaves(out)):
            for i, donated_index in _donated_under(donated, leaf):
                output = _leaf_name(out, index, kind="output", argnum=k)
                argument = _leaf_name(args[i], donated_index, kind="argument", argnum=i)
                raise DonatedTreeError(
                    f"{output} of the step shares memory with {argument} (it is that "
                    "tensor, or a view of it), which this call overwrote with its new "
                    "value; the eager step returns the old one: return a copy (.clone()) of "
                    "it. The donated trees passed to this call hold the new values and "
                    "are donated"
                )


def _refuse_copy_of_donated(new: str, old: str) -> DonatedTreeError:
    return DonatedTreeError(
        f"the step returned, as the new value of {new}, a tensor that shares memory with "
        f"{old} (it is that tensor, or a view of it); jit overwrites each donated leaf in "
        "place, one after the other, so the value could be overwritten before it is copied: "
        "return a copy (.clone()) of it"
    )


def check_new_leaves_apart(args: Sequence[Any], out: Sequence[Any], donate: Sequence[int]) -> None:
    """Refuse a new donated leaf that shares memory with another donated leaf (an eager run of
    :meth:`Jitted._donating_step`; :func:`check_copies_apart` checks the compiled copies).

    Raises:
        DonatedTreeError: A new donated leaf is (a view of) another donated input leaf.
    """
    donated = donated_memory(args, donate)
    # A leaf returned as it came is copied onto itself: nothing overwrites it.
    kept = {
        (i, index)
        for i in donate
        for index, (old, new) in enumerate(
            zip(tree.leaves(args[i]), tree.leaves(out[i]), strict=False)
        )
        if old is new
    }
    for i in donate:
        for index, leaf in enumerate(tree.leaves(out[i])):
            for j, other_index in _donated_under(donated, leaf):
                if (j, other_index) not in kept and (j, other_index) != (i, index):
                    raise _refuse_copy_of_donated(
                        _leaf_name(args[i], index, kind="argument", argnum=i),
                        _leaf_name(args[j], other_index, kind="argument", argnum=j),
                    )


def check_copies_apart(graph: torch.fx.GraphModule) -> None:
    """Refuse a copy into a step input (a donated leaf, :func:`copy_into`) from a tensor that
    shares memory with another input copied into: the copies run one after the other, so
    one could read a buffer already overwritten (a step that kept the old params in its
    state, ``{"prev": params["w"]}``, kept the new ones).

    Raises:
        DonatedTreeError: A copy's source is (a view of) another donated leaf.
    """
    copies = [
        node
        for node in graph.graph.nodes
        if node.op == "call_method"
        and node.target == "copy_"
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].op == "placeholder"
    ]
    written: dict[Any, list[torch.fx.Node]] = {}
    for node in copies:
        if node.args[1] is node.args[0]:  # an input returned as it came: nothing overwrites it
            continue
        local = _fake_local(node.args[0])
        if local is not None:
            written.setdefault(local.untyped_storage()._cdata, []).append(node.args[0])
    for node in copies:
        source = _fake_local(node.args[1])
        for target in (
            written.get(source.untyped_storage()._cdata, ()) if source is not None else ()
        ):
            if target is not node.args[0] and _may_overlap(source, _fake_local(target)):
                raise _refuse_copy_of_donated(source_name(node.args[0]), source_name(target))


def _fake_local(node: Any) -> torch.Tensor | None:
    """The (fake) tensor holding the elements of a graph node's value, or None."""
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    local = value._local_tensor if isinstance(value, DTensor) else value
    return local if isinstance(local, torch.Tensor) else None


def _may_overlap(a: torch.Tensor, b: Any) -> bool:
    """:func:`_overlap` of two fake tensors on one buffer; True where a size is symbolic."""
    sizes = (*a.shape, *a.stride(), *b.shape, *b.stride(), a.storage_offset(), b.storage_offset())
    return not all(isinstance(size, int) for size in sizes) or _overlap(a, b)


def alias_and_mark(arg: Any, call: int) -> Any:
    leaves, spec = tree.flatten(arg)
    fresh = [_alias(leaf) for leaf in leaves]
    for leaf in leaves:
        setattr(leaf, _DONATED, call)
    return tree.unflatten(spec, fresh)


def _alias(leaf: Any) -> Any:
    """A new tensor object on ``leaf``'s buffer, a DTensor on ``leaf``'s own mesh object.

    Not ``DTensor.detach``: after a compiled call it returned ZeRO-1's optimizer state on
    another, equal mesh object, and Dynamo guards a mesh by identity, so the next call
    traced the step again (docs/decisions.md).
    """
    if not isinstance(leaf, DTensor):
        return leaf.detach()
    return DTensor.from_local(
        leaf.to_local().detach(),
        leaf.device_mesh,
        leaf.placements,
        run_check=False,
        shape=leaf.shape,
        stride=leaf.stride(),
    )
