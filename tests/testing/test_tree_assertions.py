"""Tree assertions: each passes on matching trees and names what differs otherwise."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pytest
import torch

from d9d.testing import (
    assert_tree_all_finite,
    assert_tree_shapes,
    assert_trees_all_close,
    assert_trees_all_equal,
)


class State(NamedTuple):
    mu: dict
    count: torch.Tensor


def _params() -> dict:
    return {
        "layers.0.w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "layers.0.b": torch.zeros(4),
        "step": 3,
    }


# ---- assert_trees_all_close ----------------------------------------------------------------


def test_close_passes_within_default_tolerance() -> None:
    expected = _params()
    actual = {**expected, "layers.0.w": expected["layers.0.w"] * (1 + 1e-7)}
    assert_trees_all_close(actual, expected)
    assert_trees_all_close(State(expected, torch.tensor(1)), State(expected, torch.tensor(1)))


def test_close_names_worst_leaf_element_and_counts() -> None:
    expected = _params()
    w = expected["layers.0.w"].clone()
    w[1, 2] += 0.5  # 0.5 / 1e-5: the worst violation
    w[2, 3] += 1e-3
    b = expected["layers.0.b"].clone()
    b[0] = 1e-4
    actual = {**expected, "layers.0.w": w, "layers.0.b": b}
    with pytest.raises(AssertionError) as info:
        assert_trees_all_close(actual, expected)
    message = str(info.value)
    assert "2 of 3 leaves differ (3 of 17 elements in all)" in message
    assert "Worst leaf 'layers.0.w' (torch.float32, rtol=1.3e-06, atol=1e-05)" in message
    assert "2 of 12 elements differ" in message
    assert "index (1, 2): actual=6.5, expected=6.0, abs err=0.5, rel err=0.0833" in message
    assert "'layers.0.b' (torch.float32, rtol=1.3e-06, atol=1e-05): 1 of 4 differ" in message
    assert "index (0,): actual=9.99999975e-05, expected=0.0, abs err=0.0001, rel err=inf" in message


def test_close_worst_leaf_is_measured_relative_to_its_tolerance() -> None:
    expected = {"big": torch.full((2,), 1000.0), "small": torch.full((2,), 1e-3)}
    # big is off by 1 with 1e-2 allowed (100x); small by 1e-4 with 2e-8 allowed (5000x).
    actual = {"big": expected["big"] + 1.0, "small": expected["small"] + 1e-4}
    with pytest.raises(AssertionError, match=r"Worst leaf 'small'"):
        assert_trees_all_close(actual, expected, rtol=1e-5, atol=1e-8)


def test_close_explicit_tolerance_overrides_dtype_default() -> None:
    expected = {"x": torch.ones(3, dtype=torch.bfloat16)}
    actual = {"x": torch.full((3,), 1.0078125, dtype=torch.bfloat16)}  # one bf16 ulp
    assert_trees_all_close(actual, expected)
    with pytest.raises(AssertionError, match=r"rtol=0, atol=0\): 3 of 3 elements differ"):
        assert_trees_all_close(actual, expected, rtol=0, atol=0)


def test_close_structure_mismatch_lists_missing_and_unexpected_paths() -> None:
    expected = _params()
    actual = {k: v for k, v in expected.items() if k != "layers.0.b"}
    actual["layers.1.w"] = torch.zeros(1)
    match = (
        r"1 missing path\(s\) \(in expected, not in actual\):\n  'layers.0.b'\n"
        r"1 unexpected path\(s\) \(in actual, not in expected\):\n  'layers.1.w'"
    )
    with pytest.raises(AssertionError, match=match):
        assert_trees_all_close(actual, expected)


def test_close_container_mismatch_with_same_paths() -> None:
    with pytest.raises(AssertionError, match=r"differ in their containers"):
        assert_trees_all_close([torch.ones(1)], (torch.ones(1),))


def test_close_shape_dtype_and_kind_mismatches_are_named() -> None:
    expected = {"a": torch.zeros(2, 3), "b": torch.zeros(2), "c": "relu", "d": torch.zeros(1)}
    actual = {
        "a": torch.zeros(3, 2),
        "b": torch.zeros(2, dtype=torch.bfloat16),
        "c": "relu",
        "d": "zeros",
    }
    with pytest.raises(AssertionError) as info:
        assert_trees_all_close(actual, expected)
    message = str(info.value)
    assert "3 leaf(s) differ in kind, shape or dtype" in message
    assert "'a': shape (3, 2) != expected shape (2, 3)" in message
    assert "'b': dtype torch.bfloat16 != expected dtype torch.float32" in message
    assert "'d': actual is str 'zeros', expected is Tensor(shape=(1,), dtype=torch.float32)" in (
        message
    )


def test_close_compares_numbers_and_objects() -> None:
    assert_trees_all_close(
        {"lr": 0.1, "n": 2, "act": "gelu"}, {"lr": 0.1 + 1e-12, "n": 2, "act": "gelu"}
    )
    assert_trees_all_close({"loss": torch.tensor(2.5)}, {"loss": 2.5})
    with pytest.raises(AssertionError, match=r"'n' \(torch.int64, rtol=0, atol=0\)"):
        assert_trees_all_close({"n": 3}, {"n": 2})
    with pytest.raises(
        AssertionError, match=r"(?s)'act' \(object\).*actual='gelu', expected='relu'"
    ):
        assert_trees_all_close({"act": "gelu"}, {"act": "relu"})


def test_close_nan_and_inf() -> None:
    nan_inf = torch.tensor([math.nan, math.inf, -math.inf])
    assert_trees_all_close({"x": nan_inf}, {"x": nan_inf.clone()}, equal_nan=True)
    with pytest.raises(
        AssertionError, match=r"(?s)1 of 3 elements differ.*index \(0,\): actual=nan"
    ):
        assert_trees_all_close({"x": nan_inf}, {"x": nan_inf.clone()})
    with pytest.raises(AssertionError, match=r"index \(1,\): actual=inf, expected=-inf"):
        assert_trees_all_close(
            {"x": torch.tensor([0.0, math.inf])}, {"x": torch.tensor([0.0, -math.inf])}
        )


def test_close_accepts_numpy_leaves() -> None:
    assert_trees_all_close({"x": np.ones(3, dtype=np.float32)}, {"x": torch.ones(3)})


@pytest.mark.parametrize("bad", [-1.0, math.inf, "1e-3"])
def test_close_rejects_bad_tolerance(bad: object) -> None:
    with pytest.raises(ValueError, match=r"rtol=.* must be a finite number >= 0"):
        assert_trees_all_close({}, {}, rtol=bad)


def test_close_rejects_meta_tensors() -> None:
    with pytest.raises(TypeError, match=r"meta tensor has no values"):
        assert_trees_all_close({"w": torch.empty(2, device="meta")}, {"w": torch.empty(2)})


# ---- assert_trees_all_equal ----------------------------------------------------------------


def test_equal_passes_on_identical_bits_including_nan() -> None:
    tree = {"w": torch.tensor([1.0, math.nan, -0.0]), "i": torch.arange(3), "step": 7, "f": 0.5}
    copy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tree.items()}
    assert_trees_all_equal(tree, copy)


def test_equal_reports_first_differing_bits() -> None:
    expected = {"a": torch.zeros(2, 2), "b": torch.zeros(3, dtype=torch.bfloat16)}
    a = torch.zeros(2, 2)
    a[1, 0] = -0.0
    b = expected["b"].clone()
    b[2] = 1.0
    with pytest.raises(AssertionError) as info:
        assert_trees_all_equal({"a": a, "b": b}, expected)
    message = str(info.value)
    assert "Trees are not equal: 2 of 2 leaves differ (2 of 7 elements in all)" in message
    assert "First leaf 'a' (torch.float32, bitwise): 1 of 4 elements differ" in message
    assert "index (1, 0): actual=-0.0 (bits 0x80000000), expected=0.0 (bits 0x00000000)" in message
    assert (
        "'b' (torch.bfloat16, bitwise): 1 of 3 differ; first: index (2,): actual=1.0 (bits 0x3f80)"
        in message
    )


def test_equal_rejects_close_but_different_values_and_number_types() -> None:
    with pytest.raises(AssertionError, match=r"1 of 1 leaves differ"):
        assert_trees_all_equal({"x": torch.tensor(1.0)}, {"x": torch.tensor(1.0 + 1e-7)})
    with pytest.raises(AssertionError, match=r"'n': actual is int 1, expected is float 1.0"):
        assert_trees_all_equal({"n": 1}, {"n": 1.0})
    with pytest.raises(AssertionError, match=r"'x': actual is float 1.0, expected is Tensor"):
        assert_trees_all_equal({"x": 1.0}, {"x": torch.tensor(1.0)})


# ---- assert_tree_all_finite ----------------------------------------------------------------


def test_finite_passes_and_skips_integer_and_object_leaves() -> None:
    assert_tree_all_finite({"w": torch.randn(3), "n": torch.arange(3), "act": "gelu", "lr": 0.1})


def test_finite_names_each_bad_path_with_counts() -> None:
    w = torch.zeros(2, 3)
    w[0, 2] = math.nan
    w[1, 0] = math.nan
    w[1, 1] = math.inf
    tree = {"w": w, "ok": torch.ones(2), "state": (torch.tensor([-math.inf]),), "lr": math.nan}
    match = (
        r"3 of 4 leaves hold non-finite values:\n"
        r"  'lr': 1 NaN of 1 elements; first at index \(\)\n"
        r"  'state.0': 1 -Inf of 1 elements; first at index \(0,\)\n"
        r"  'w': 2 NaN, 1 \+Inf of 6 elements; first at index \(0, 2\)"
    )
    with pytest.raises(AssertionError, match=match):
        assert_tree_all_finite(tree)


# ---- assert_tree_shapes --------------------------------------------------------------------


def test_shapes_from_tree_and_from_function() -> None:
    tree = State({"w": torch.zeros(4, 8), "b": torch.zeros(8)}, torch.tensor(0))
    assert_tree_shapes(tree, State({"w": (4, 8), "b": torch.Size([8])}, ()))
    assert_tree_shapes({"w": torch.zeros(4, 4), "v": torch.zeros(4, 4)}, lambda path: (4, 4))


def test_shapes_names_mismatched_paths() -> None:
    tree = {"w": torch.zeros(4, 8), "b": torch.zeros(8), "act": "gelu", "n": 3}
    match = (
        r"3 of 4 leaves have unexpected shapes:\n"
        r"  'act': str 'gelu' has no shape, expected \(\)\n"
        r"  'b': shape \(8,\), expected \(4,\)\n"
        r"  'w': shape \(4, 8\), expected \(8, 4\)"
    )
    with pytest.raises(AssertionError, match=match):
        assert_tree_shapes(tree, {"w": (8, 4), "b": (4,), "act": (), "n": ()})
    with pytest.raises(AssertionError, match=r"'w': shape \(4, 8\), expected \(4, 4\)"):
        assert_tree_shapes(tree, lambda path: {"w": (4, 4), "b": (8,)}.get(path, ()))


def test_shapes_structure_mismatch_lists_paths() -> None:
    with pytest.raises(AssertionError, match=r"(?s)missing path\(s\).*\n  'b'"):
        assert_tree_shapes({"w": torch.zeros(1)}, {"w": (1,), "b": (1,)})


def test_shapes_rejects_shapes_that_are_not_int_tuples() -> None:
    with pytest.raises(TypeError, match=r"shape for 'w.0' from the shapes tree is 4; give each"):
        assert_tree_shapes({"w": torch.zeros(4, 8)}, {"w": [4, 8]})
    with pytest.raises(TypeError, match=r"shape for 'w' from the shapes function is None"):
        assert_tree_shapes({"w": torch.zeros(4)}, lambda path: None)
