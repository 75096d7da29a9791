"""rms_norm and fused_add_rms_norm: every backend against the reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

import d9d.kernels as K
from d9d.errors import KernelInputError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(3, 7, 1000), (1, 1, 4096), (5, 123, 123), (2, 33)]


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


def _grads(fn, inputs, upstream):
    inputs = [_leaf(t) for t in inputs]
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward(outputs, upstream[: len(outputs)])
    return [o.detach() for o in outputs], [t.grad for t in inputs]


def test_reference_matches_torch():
    x, w = torch.randn(4, 10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    expected = torch.nn.functional.rms_norm(x, (10,), w, eps=1e-5)
    torch.testing.assert_close(K.rms_norm(x, w, 1e-5, backend="reference"), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_triton(shape, dtype, device, assert_close):
    torch.manual_seed(0)
    x = torch.randn(shape, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype)
    upstream = [torch.randn(shape, device=device).to(dtype)]
    got, got_grads = _grads(lambda a, b: K.rms_norm(a, b, backend="triton"), [x, w], upstream)
    ref, ref_grads = _grads(lambda a, b: K.rms_norm(a, b, backend="reference"), [x, w], upstream)
    for actual, expected in zip(got + got_grads, ref + ref_grads, strict=True):
        assert_close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_add_rms_norm_triton(shape, dtype, device, assert_close):
    torch.manual_seed(0)
    x, residual = (torch.randn(shape, device=device).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype)
    upstream = [torch.randn(shape, device=device).to(dtype) for _ in range(2)]
    inputs = [x, residual, w]
    got, got_grads = _grads(lambda *a: K.fused_add_rms_norm(*a, backend="triton"), inputs, upstream)
    ref, ref_grads = _grads(
        lambda *a: K.fused_add_rms_norm(*a, backend="reference"), inputs, upstream
    )
    for actual, expected in zip(got + got_grads, ref + ref_grads, strict=True):
        assert_close(actual, expected, dtype)


def test_fused_add_rms_norm_only_normed_used(device, assert_close):
    x, residual, w = torch.randn(3, 40), torch.randn(3, 40), torch.randn(40)
    grads = []
    for backend in ("triton", "reference"):
        leaves = [_leaf(t.to(device)) for t in (x, residual, w)]
        K.fused_add_rms_norm(*leaves, backend=backend)[0].square().sum().backward()
        grads.append([t.grad for t in leaves])
    for actual, expected in zip(*grads, strict=True):
        assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_non_contiguous_inputs(backend, device, assert_close):
    torch.manual_seed(0)
    x = torch.randn(7, 3, 300, device=device).transpose(0, 1)  # [3, 7, 300], strided
    w = torch.randn(600, device=device)[::2]
    upstream = [torch.randn(3, 7, 300, device=device)]
    got, got_grads = _grads(lambda a, b: K.rms_norm(a, b, backend=backend), [x, w], upstream)
    dense = [x.contiguous(), w.contiguous()]
    ref, ref_grads = _grads(lambda a, b: K.rms_norm(a, b, backend="reference"), dense, upstream)
    for actual, expected in zip(got + got_grads, ref + ref_grads, strict=True):
        assert_close(actual, expected, torch.float32)


def test_float32_weight_with_bfloat16_activations(device, assert_close):
    x = torch.randn(4, 64, device=device).to(torch.bfloat16)
    w = torch.randn(64, device=device)
    upstream = [torch.randn(4, 64, device=device).to(torch.bfloat16)]
    got, got_grads = _grads(lambda a, b: K.rms_norm(a, b, backend="triton"), [x, w], upstream)
    ref, ref_grads = _grads(lambda a, b: K.rms_norm(a, b, backend="reference"), [x, w], upstream)
    assert got[0].dtype == torch.bfloat16 and got_grads[1].dtype == torch.float32
    for actual, expected in zip(got + got_grads, ref + ref_grads, strict=True):
        assert_close(actual, expected, torch.bfloat16)


def test_errors(device):
    x = torch.randn(2, 8)
    with pytest.raises(KernelInputError, match=r"rms_norm: weight.shape=\(7,\), expected \(8,\)"):
        K.rms_norm(x, torch.ones(7))
    with pytest.raises(KernelInputError, match=r"x must be a floating-point tensor.*int64"):
        K.rms_norm(x.long(), torch.ones(8))
    with pytest.raises(KernelInputError, match=r"eps=-1.0 must be >= 0"):
        K.rms_norm(x, torch.ones(8), eps=-1.0)
    with pytest.raises(KernelInputError, match=r"x must have at least one dim"):
        K.rms_norm(torch.tensor(1.0), torch.ones(()))
    with pytest.raises(KernelInputError, match=r"x.dtype=torch.float32, residual.dtype=torch.f"):
        K.fused_add_rms_norm(x, x.double(), torch.ones(8))
    with pytest.raises(KernelInputError, match=r"residual.shape=\(2, 4\), expected \(2, 8\)"):
        K.fused_add_rms_norm(x, torch.ones(2, 4), torch.ones(8))
    with pytest.raises(KernelInputError, match=r"hidden size 65537 > 65536"):
        K.rms_norm(
            torch.ones(1, 65537, device=device), torch.ones(65537, device=device), backend="triton"
        )
