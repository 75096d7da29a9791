"""Kernel tests run the Triton backends on CUDA when there is one, else on CPU under
Triton's interpreter. ``TRITON_INTERPRET`` must be set before the kernels are decorated,
which happens on their first use, so setting it here at collection time is early enough;
other test directories do not use Triton and are unaffected by it."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Tolerance per dtype, relative to the largest magnitude of the expected tensor (atol) and to
# each element (rtol). bfloat16 allows about three units in the last place: the interpreter
# rounds float32 -> bfloat16 toward zero where torch rounds to nearest (1 ulp), and a
# backward compounds a rounded forward (1-2 more).
TOLERANCES = {
    torch.float32: 1e-5,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """``actual`` equals ``expected`` within ``TOLERANCES[dtype]``; dtypes and shapes equal."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    tol = TOLERANCES[dtype]
    scale = max(expected.detach().abs().max().item(), 1e-6) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.detach().float(), expected.detach().float(), atol=tol * scale, rtol=tol
    )


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def assert_close():
    """The per-dtype comparison: ``assert_close(actual, expected, dtype)``."""
    return _assert_close


@pytest.fixture
def undefined_masked_lanes(monkeypatch):
    """Under the interpreter, a masked ``tl.load`` without ``other`` reads NaN where it read 0:
    on a GPU those lanes are undefined, so a kernel that lets them reach a result is wrong
    there while the interpreter's zeros hide it. Skips on CUDA (nothing to patch)."""
    if DEVICE == "cuda":
        pytest.skip("patches Triton's CPU interpreter")
    import numpy as np
    from triton.runtime import interpreter

    load = interpreter.InterpreterBuilder.create_masked_load

    def create_masked_load(self, ptrs, mask, other, *args, **kwargs):
        if other is None:
            dtype = ptrs.get_element_ty()
            np_dtype = interpreter._get_np_dtype(dtype)
            fill = np.nan if np.issubdtype(np_dtype, np.floating) else 0
            other = interpreter.TensorHandle(np.full(ptrs.data.shape, fill, np_dtype), dtype)
        return load(self, ptrs, mask, other, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", create_masked_load)
