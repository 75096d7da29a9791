"""swiglu: every backend against the reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

import d9d.kernels as K
from d9d.errors import KernelInputError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(3, 7, 1000), (1, 1, 4096), (5, 123, 123), (1,)]


def _run(backend, gate, up, upstream):
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    out = K.swiglu(gate, up, backend=backend)
    out.backward(upstream)
    return out.detach(), gate.grad, up.grad


def test_reference_matches_torch():
    gate, up = torch.randn(5, 9, dtype=torch.float64), torch.randn(5, 9, dtype=torch.float64)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(K.swiglu(gate, up, backend="reference"), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_triton(shape, dtype, device, assert_close):
    torch.manual_seed(0)
    gate, up, upstream = (torch.randn(shape, device=device).to(dtype) for _ in range(3))
    got = _run("triton", gate, up, upstream)
    ref = _run("reference", gate, up, upstream)
    for actual, expected in zip(got, ref, strict=True):
        assert_close(actual, expected, dtype)


def test_non_contiguous_halves_of_a_fused_projection(device, assert_close):
    torch.manual_seed(0)
    fused = torch.randn(3, 7, 2 * 300, device=device)
    gate, up = fused.chunk(2, dim=-1)  # views with row stride 600
    upstream = torch.randn(3, 7, 300, device=device)
    got = _run("triton", gate, up, upstream)
    ref = _run("reference", gate.contiguous(), up.contiguous(), upstream)
    for actual, expected in zip(got, ref, strict=True):
        assert_close(actual, expected, torch.float32)


def test_errors():
    with pytest.raises(KernelInputError, match=r"swiglu: up.shape=\(3,\), expected \(2,\)"):
        K.swiglu(torch.ones(2), torch.ones(3))
    with pytest.raises(KernelInputError, match=r"gate.dtype=torch.float32, up.dtype=torch.float16"):
        K.swiglu(torch.ones(2), torch.ones(2, dtype=torch.float16))
    with pytest.raises(KernelInputError, match=r"up must be a floating-point tensor"):
        K.swiglu(torch.ones(2), torch.ones(2, dtype=torch.int32))
    with pytest.raises(KernelInputError, match=r"gate must be a torch.Tensor, got <class 'list'>"):
        K.swiglu([1.0], torch.ones(1))
