"""Compare two pytrees leaf by leaf: within a tolerance, or bit for bit."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ._leaves import (
    as_tensor,
    describe,
    format_value,
    is_array,
    listing,
    paired_leaves,
    unravel,
)

__all__ = ["assert_trees_all_close", "assert_trees_all_equal"]

# (rtol, atol) per dtype when the caller gives none; the values torch.testing.assert_close
# uses. Integer and bool leaves compare exactly; other floating dtypes (float8) get one
# machine epsilon of relative slack (see `_tolerances`).
_DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex32: (1e-3, 1e-5),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}

# A numeric leaf pair ready to compare: path, actual, expected (CPU tensors of one shape),
# and the dtype whose tolerance applies.
_Pair = tuple[str, torch.Tensor, torch.Tensor, torch.dtype]


@dataclass(frozen=True)
class _Mismatch:
    path: str
    label: str  # what was compared, e.g. "torch.float32, rtol=1.3e-06, atol=1e-05"
    count: int  # elements that differ
    numel: int
    index: tuple[int, ...] | None  # of the reported element; None for a non-numeric leaf
    actual: Any
    expected: Any
    abs_err: float | None  # None for non-numeric leaves and bitwise comparisons
    rel_err: float | None
    score: float  # how far outside its tolerance the reported element is; larger is worse

    def element(self) -> str:
        text = f"actual={format_value(self.actual)}, expected={format_value(self.expected)}"
        if self.index is not None:
            text = f"index {self.index}: {text}"
        if self.abs_err is not None:
            text += f", abs err={self.abs_err:.3g}, rel err={self.rel_err:.3g}"
        return text


class _Shown(str):
    """A preformatted value: printed as is, without quotes."""

    def __repr__(self) -> str:
        return str(self)


def _tolerances(dtype: torch.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    if dtype in _DEFAULT_TOLERANCES:
        default = _DEFAULT_TOLERANCES[dtype]
    elif dtype.is_floating_point:
        default = (torch.finfo(dtype).eps, 1e-5)
    else:
        default = (0.0, 0.0)
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


def _check_tolerance(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, int | float) and 0 <= value < math.inf):
        raise ValueError(
            f"{name}={value!r} must be a finite number >= 0, or None for the per-dtype default."
        )


def _tensor_pairs(
    actual: Any, expected: Any, *, exact_types: bool
) -> tuple[list[_Pair], list[_Mismatch], int]:
    """Numeric leaf pairs, the mismatched non-numeric leaves, and the number of leaves.

    Raises if a leaf pair differs in kind, shape or dtype; non-numeric leaves compare by ``==``.
    """
    problems: list[str] = []
    pairs: list[_Pair] = []
    objects: list[_Mismatch] = []
    triples = paired_leaves(actual, expected)
    for path, a, e in triples:
        ta, te = as_tensor(a), as_tensor(e)
        arrays = (is_array(a), is_array(e))
        if (ta is None) != (te is None) or (exact_types and arrays[0] != arrays[1]):
            problems.append(f"{path!r}: actual is {describe(a)}, expected is {describe(e)}")
        elif ta is None or te is None:
            if not (type(a) is type(e) and bool(a == e)):
                objects.append(_Mismatch(path, "object", 1, 1, None, a, e, None, None, math.inf))
        elif exact_types and not arrays[0] and type(a) is not type(e):
            problems.append(f"{path!r}: actual is {describe(a)}, expected is {describe(e)}")
        elif ta.shape != te.shape:
            problems.append(
                f"{path!r}: shape {tuple(ta.shape)} != expected shape {tuple(te.shape)}"
            )
        elif all(arrays) and ta.dtype != te.dtype:
            problems.append(f"{path!r}: dtype {ta.dtype} != expected dtype {te.dtype}")
        else:
            # A Python number takes the tolerance of the tensor it is compared with.
            dtype = ta.dtype if arrays[0] or not arrays[1] else te.dtype
            pairs.append((path, ta, te, dtype))
    if problems:
        raise AssertionError(
            f"Trees have the same structure but {len(problems)} leaf(s) differ in kind, "
            f"shape or dtype:\n{listing(problems)}"
        )
    return pairs, objects, len(triples)


def _close_mismatch(
    pair: _Pair, rtol: float | None, atol: float | None, equal_nan: bool
) -> _Mismatch | None:
    path, a, e, dtype = pair
    rtol, atol = _tolerances(dtype, rtol, atol)
    work = torch.complex128 if a.is_complex() or e.is_complex() else torch.float64
    a64, e64 = a.to(work), e.to(work)
    diff = (a64 - e64).abs()
    allowed = atol + rtol * e64.abs()
    # Infinities are close only to the same infinity (their diff is not <= an inf allowance).
    ok = ((diff <= allowed) & a64.isfinite() & e64.isfinite()) | (a64 == e64)
    if equal_nan:
        ok |= a64.isnan() & e64.isnan()
    count = int((~ok).sum())
    if count == 0:
        return None
    ratio = (diff / allowed).nan_to_num(nan=math.inf)
    flat = int(torch.where(ok, -1.0, ratio).reshape(-1).argmax())
    abs_err = float(diff.reshape(-1)[flat])
    expected_abs = float(e64.abs().reshape(-1)[flat])
    return _Mismatch(
        path=path,
        label=f"{dtype}, rtol={rtol:g}, atol={atol:g}",
        count=count,
        numel=a.numel(),
        index=unravel(flat, a.shape),
        # Values in their own dtype, so an int shows as an int.
        actual=a.reshape(-1)[flat].item(),
        expected=e.reshape(-1)[flat].item(),
        abs_err=abs_err,
        rel_err=abs_err / expected_abs if expected_abs != 0 else math.inf,
        score=float(ratio.reshape(-1)[flat]),
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """One row of raw bytes per element."""
    flat = t.reshape(-1).contiguous()
    return flat.view(torch.uint8).reshape(flat.numel(), flat.element_size())


def _equal_mismatch(pair: _Pair) -> _Mismatch | None:
    path, a, e, _ = pair
    a_bits, e_bits = _bits(a), _bits(e)
    differs = (a_bits != e_bits).any(dim=1)
    count = int(differs.sum())
    if count == 0:
        return None
    flat = int(differs.to(torch.uint8).argmax())  # the first differing element

    def shown(t: torch.Tensor, bits: torch.Tensor) -> _Shown:
        word = int.from_bytes(bytes(bits[flat].tolist()), sys.byteorder)
        value = format_value(t.reshape(-1)[flat].item())
        return _Shown(f"{value} (bits 0x{word:0{2 * bits.shape[1]}x})")

    return _Mismatch(
        path=path,
        label=f"{a.dtype}, bitwise",
        count=count,
        numel=a.numel(),
        index=unravel(flat, a.shape),
        actual=shown(a, a_bits),
        expected=shown(e, e_bits),
        abs_err=None,
        rel_err=None,
        score=float(count),
    )


def _report(
    title: str, mismatches: list[_Mismatch], pairs: list[_Pair], n_leaves: int, *, which: str
) -> str:
    worst, *others = mismatches
    failed = sum(m.count for m in mismatches)
    n_elements = sum(a.numel() for _, a, _, _ in pairs) + n_leaves - len(pairs)
    lines = [
        f"{title}: {len(mismatches)} of {n_leaves} leaves differ "
        f"({failed} of {n_elements} elements in all).",
        f"{which} leaf {worst.path!r} ({worst.label}): "
        f"{worst.count} of {worst.numel} elements differ.",
        f"  {which} element: {worst.element()}",
    ]
    if others:
        lines.append("Other differing leaves:")
        lines.append(
            listing(
                [
                    f"{m.path!r} ({m.label}): {m.count} of {m.numel} differ; {which.lower()}: "
                    f"{m.element()}"
                    for m in others
                ]
            )
        )
    return "\n".join(lines)


def assert_trees_all_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    equal_nan: bool = False,
) -> None:
    """Assert two pytrees have the same structure, shapes, dtypes and values within a tolerance.

    An element passes when ``|actual - expected| <= atol + rtol * |expected|`` (computed in
    float64) or when both are the same infinity. On failure the message names the worst
    leaf (whose element lies furthest outside its tolerance, measured in multiples of it),
    that element's index, both values, its absolute and relative error, and how many
    leaves and elements failed. A DTensor leaf is compared through ``full_tensor()``, which
    gathers it: call this on every rank of its mesh. A DTensor may be compared with a plain
    tensor (a sharded result against a single-device reference). A Python number may stand
    against a 0-d tensor and takes the tensor's tolerance; non-numeric leaves must be ``==``.

    Args:
        actual: The tree under test.
        expected: The reference tree.
        rtol: Relative tolerance; None takes each leaf's dtype default (float32: 1.3e-6,
            bfloat16: 1.6e-2, float16: 1e-3, float64 and Python floats: 1e-7, integers: 0).
        atol: Absolute tolerance; None takes the dtype default (1e-5 for float32, bfloat16
            and float16, 1e-7 for float64 and Python floats, 0 for integers).
        equal_nan: Whether NaN in both trees at the same element counts as equal.

    Raises:
        AssertionError: The structures differ (missing and unexpected paths are listed), a
            leaf's kind, shape or dtype differs, or a value is out of tolerance.
        ValueError: ``rtol`` or ``atol`` is negative or not finite.

    Example:
        >>> import torch
        >>> assert_trees_all_close({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-7})
    """
    _check_tolerance("rtol", rtol)
    _check_tolerance("atol", atol)
    pairs, objects, n_leaves = _tensor_pairs(actual, expected, exact_types=False)
    found = [_close_mismatch(pair, rtol, atol, equal_nan) for pair in pairs]
    mismatches = [m for m in found if m is not None] + objects
    if mismatches:
        mismatches.sort(key=lambda m: -m.score)  # stable: path order among ties
        raise AssertionError(
            _report("Trees are not close", mismatches, pairs, n_leaves, which="Worst")
        )


def assert_trees_all_equal(actual: Any, expected: Any) -> None:
    """Assert two pytrees are bitwise equal: structure, shapes, dtypes and every bit.

    Unlike ``==``, NaN equals a NaN with the same bits and ``0.0`` differs from ``-0.0``,
    which is what a checkpoint round trip must preserve. Python numbers must also agree in
    type (``1`` is not ``1.0``); non-numeric leaves must be ``==``. A DTensor leaf is
    compared through ``full_tensor()``, which gathers it: call this on every rank. On
    failure the message names the first differing leaf, the index and bits of its first
    differing element, and how many leaves and elements differ.

    Args:
        actual: The tree under test.
        expected: The reference tree.

    Raises:
        AssertionError: The structures, a leaf's kind, shape or dtype, or any bit differ.

    Example:
        >>> import torch
        >>> assert_trees_all_equal({"w": torch.zeros(2)}, {"w": torch.zeros(2)})
    """
    pairs, objects, n_leaves = _tensor_pairs(actual, expected, exact_types=True)
    found = [_equal_mismatch(pair) for pair in pairs]
    mismatches = [m for m in found if m is not None] + objects
    if mismatches:
        raise AssertionError(
            _report("Trees are not equal", mismatches, pairs, n_leaves, which="First")
        )
