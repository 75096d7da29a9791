"""Every Triton op that takes ``group_sizes`` reads a strided view of it (a column of a
``[E, 2]`` table) as its values, not as the first ``E`` elements of its storage."""

from __future__ import annotations

import pytest
import torch

import d9d.kernels as K

SIZES = [9, 0, 13, 15]
# block (1, 128) for the activations of fp8_gemm, (128, 128) for weights and by-expert grads.
RECIPES = {"tensorwise": (128, 128), "rowwise": (128, 128), "blockwise": (128, 1)}


def _strided(sizes: torch.Tensor) -> torch.Tensor:
    """``sizes`` as column 0 of ``[[s, 0], ...]``: stride 2, so reading the storage densely
    gives ``[s0, 0, s1, 0]``, sizes that still sum to at most ``T`` (wrong rows, no crash)."""
    table = torch.stack([sizes, torch.zeros_like(sizes)], dim=1)
    strided = table[:, 0]
    assert strided.stride() == (2,) and torch.equal(strided, sizes)
    return strided


def _inputs(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(sum(SIZES), 24, device=device), torch.tensor(SIZES, device=device)


def test_grouped_gemm_forward_and_backward(device, assert_close):
    x, sizes = _inputs(device)
    w = torch.randn(len(SIZES), 24, 10, device=device) * 24**-0.5
    upstream = torch.randn(x.shape[0], 10, device=device)
    results = []
    for backend, group_sizes in (("triton", _strided(sizes)), ("reference", sizes)):
        x_leaf, w_leaf = x.detach().requires_grad_(), w.detach().requires_grad_()
        out = K.grouped_gemm(x_leaf, w_leaf, group_sizes, backend=backend)
        out.backward(upstream)
        results.append((out.detach(), x_leaf.grad, w_leaf.grad))
    for actual, expected in zip(*results, strict=True):
        assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_quantize_by_expert(recipe, device):
    x, sizes = _inputs(device)
    options = {"dim": -2, "block": RECIPES[recipe]}
    got = K.fp8_quantize(x, recipe, group_sizes=_strided(sizes), backend="triton", **options)
    ref = K.fp8_quantize(x, recipe, group_sizes=sizes, backend="reference", **options)
    assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8))  # bit for bit
    assert torch.equal(got[1], ref[1])


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_grouped_gemm(recipe, device, assert_close):
    x, sizes = _inputs(device)
    a = K.fp8_quantize(x, recipe)
    b = K.fp8_quantize(
        torch.randn(len(SIZES), 24, 10, device=device), recipe, dim=-2, block=(128, 128)
    )
    f32 = torch.float32
    got = K.fp8_grouped_gemm(*a, *b, _strided(sizes), recipe, f32, backend="triton")
    ref = K.fp8_grouped_gemm(*a, *b, sizes, recipe, f32, backend="reference")
    assert_close(got, ref, f32)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_grouped_gemm_k(recipe, device, assert_close):
    x, sizes = _inputs(device)
    dy = torch.randn(x.shape[0], 10, device=device)
    options = {"dim": -2, "group_sizes": sizes}
    a = K.fp8_quantize(x, recipe, block=RECIPES[recipe], **options)
    b = K.fp8_quantize(dy, recipe, block=(128, 128), **options)
    f32 = torch.float32
    got = K.fp8_grouped_gemm_k(*a, *b, _strided(sizes), recipe, f32, backend="triton")
    ref = K.fp8_grouped_gemm_k(*a, *b, sizes, recipe, f32, backend="reference")
    assert_close(got, ref, f32)
