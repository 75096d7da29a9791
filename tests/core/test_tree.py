from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import NamedTuple

import optree
import pytest
import torch
from torch.distributed.tensor import DTensor

from d9d import tree


class _State(NamedTuple):
    count: torch.Tensor
    mu: dict[str, torch.Tensor]


def _state() -> _State:
    return _State(torch.tensor(3), {"layers.0.w": torch.ones(2), "embed.weight": torch.zeros(3)})


def test_paths_join_named_tuple_fields_and_dict_keys() -> None:
    assert tree.paths({"opt": _state()}) == [
        "opt.count",
        "opt.mu.embed.weight",
        "opt.mu.layers.0.w",
    ]


def test_flatten_unflatten_round_trip_keeps_insertion_order() -> None:
    params = {"b": torch.ones(1), "a": torch.zeros(1)}
    leaves, spec = tree.flatten(params)
    back = tree.unflatten(spec, leaves)
    assert list(back) == ["b", "a"]
    assert all(back[k] is params[k] for k in params)


def test_none_is_an_empty_subtree() -> None:
    assert tree.leaves({"a": None, "b": 1}) == [1]
    assert tree.map(lambda x: x + 1, {"a": None, "b": 1}) == {"a": None, "b": 2}


def test_map_with_path_passes_paths_and_rest_leaves() -> None:
    out = tree.map_with_path(lambda p, x, y: (p, x + y), {"w": 1, "s": (2,)}, {"w": 10, "s": (20,)})
    assert out == {"w": ("w", 11), "s": (("s.0", 22),)}


def test_same_structure() -> None:
    assert tree.same_structure(_state(), _state())
    assert not tree.same_structure({"a": 1}, {"a": 1, "b": 2})
    assert not tree.same_structure({"a": 1}, {"a": (1,)})


def test_same_paths_lines_leaves_up_by_path_not_container() -> None:
    assert tree.same_paths(_state(), _state())
    assert tree.same_paths({"a": 1, "b": None}, {"a": 2})  # None is an empty subtree
    assert tree.same_paths({"s": (1, 2)}, {"s": [1, 2]})  # containers are not compared
    assert not tree.same_paths({"a": 1}, {"a": 1, "b": 2})
    assert not tree.same_paths({"a": 1}, {"a": (1,)})
    assert not tree.same_paths({"0": 1}, (1,))  # key "0" is not index 0


@pytest.mark.compile  # backend "eager": Dynamo tracing only (~1 s)
def test_same_paths_traces_where_a_spec_comparison_does_not() -> None:
    """torch 2.11's Dynamo cannot trace ``PyTreeSpec.__eq__``; layout checks inside a jitted
    step compare paths instead."""

    def f(a, b):
        return a["w"] + 1 if tree.same_paths(a, b) else a["w"] - 1

    a, b = (
        {"w": torch.zeros(2), "s": (torch.zeros(1),)},
        {"w": torch.zeros(2), "s": [torch.zeros(1)]},
    )
    torch._dynamo.reset()
    try:
        assert torch.compile(f, backend="eager", fullgraph=True)(a, b).tolist() == [1.0, 1.0]
    finally:
        torch._dynamo.reset()


def test_dtensor_is_one_leaf(one_rank_mesh) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    t = distribute_tensor(torch.ones(4, 2), one_rank_mesh, [Shard(0)])
    pairs, _ = tree.flatten_with_paths({"x": t, "y": [t]})
    assert [p for p, _ in pairs] == ["x", "y.0"]
    assert all(isinstance(leaf, DTensor) for _, leaf in pairs)


def _flat_and_not() -> list[dict]:
    """Dicts of tensors keyed by strings (the shortcut) and dicts just off it; every leaf its
    own tensor, keys not in sorted order."""
    t = [torch.full((1,), float(i)) for i in range(8)]
    return [
        {"layers.1.w": t[0], "layers.0.w": t[1], "embed": t[2]},  # the shortcut: sorted keys
        {"embed": t[3], "layers.1.w": t[4], "layers.0.w": t[5]},  # the same paths, other order
        {},
        {"b": t[0], "a": None},  # None: an empty subtree
        {"b": t[0], "a": 3},  # a number leaf
        {1: t[0], 0: t[1]},  # keys that are not strings
        {"b": t[0], "a": (t[1],)},  # a nested container
        OrderedDict(b=t[6], a=t[7]),  # optree keeps an OrderedDict's order
        defaultdict(list, b=t[6], a=t[7]),  # a dict subclass: optree's own node
    ]


_KINDS = [
    "flat",
    "other-order",
    "empty",
    "none",
    "number",
    "int-keys",
    "nested",
    "ordered",
    "default",
]


@pytest.mark.parametrize("value", _flat_and_not(), ids=_KINDS)
def test_flat_dict_shortcut_gives_optrees_leaves_paths_and_comparisons(value: dict) -> None:
    expected_leaves = optree.tree_leaves(value, none_is_leaf=False)
    assert [id(x) for x in tree.leaves(value)] == [id(x) for x in expected_leaves]
    pairs, spec = tree.flatten_with_paths(value)
    assert tree.paths(value) == [p for p, _ in pairs]
    assert [(p, id(x)) for p, x in tree.leaves_with_paths(value)] == [(p, id(x)) for p, x in pairs]
    marks = [object() for _ in expected_leaves]
    rebuilt, expected_tree = tree.with_leaves(value, marks), tree.unflatten(spec, marks)
    assert type(rebuilt) is type(expected_tree) and list(rebuilt) == list(expected_tree)
    assert [id(x) for x in tree.leaves(rebuilt)] == [id(x) for x in tree.leaves(expected_tree)]
    for other in _flat_and_not():
        expected = optree.tree_paths(value, none_is_leaf=False) == optree.tree_paths(
            other, none_is_leaf=False
        )
        assert tree.same_paths(value, other) == expected


@pytest.mark.compile  # backend "eager": Dynamo tracing only (~1 s)
def test_flat_dict_shortcut_traces_as_it_runs() -> None:
    """Inside a jitted step the shortcut is what Dynamo traces: the same answers."""

    def f(a, b):
        ok = tree.same_paths(a, b) and tree.paths(a) == ["x", "y"]
        return sum(tree.leaves(a)) + (1 if ok else -1)

    a, b = {"y": torch.ones(2), "x": torch.zeros(2)}, {"x": torch.ones(2), "y": torch.ones(2)}
    torch._dynamo.reset()
    try:
        assert torch.compile(f, backend="eager", fullgraph=True)(a, b).tolist() == [2.0, 2.0]
        assert f({"y": torch.ones(2), "z": torch.zeros(2)}, b).tolist() == [0.0, 0.0]
    finally:
        torch._dynamo.reset()
