"""A NaN in one expert's rows or weights is NaN in that expert's results only, as in a plain
loop over experts, on every backend of the ops grouped by expert (references included: they
mask whole products, and ``0 * NaN`` must not carry a NaN to another expert)."""

from __future__ import annotations

import pytest
import torch

import d9d.kernels as K

SIZES = [3, 4, 2]


def _nan_map(t: torch.Tensor) -> list[bool]:
    """Whether each row of ``t`` (each matrix if 3-d) holds a NaN."""
    return t.isnan().flatten(1).any(1).tolist()


def _grouped_gemm(backend, x, w, sizes):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = K.grouped_gemm(x, w, sizes, backend=backend)
    out.sum().backward()
    return _nan_map(out), _nan_map(x.grad), _nan_map(w.grad)


def _loop(x, w, sizes):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = torch.cat([rows @ w[e] for e, rows in enumerate(x.split(sizes.tolist()))])
    out.sum().backward()
    return _nan_map(out), _nan_map(x.grad), _nan_map(w.grad)


@pytest.mark.parametrize("where", ["x", "w"])
@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_grouped_gemm(backend, where, device):
    torch.manual_seed(0)
    x, w = torch.randn(sum(SIZES), 5, device=device), torch.randn(3, 5, 4, device=device)
    if where == "x":
        x[0, 1] = float("nan")  # expert 0's first row
    else:
        w[1, 2, 0] = float("nan")  # expert 1's weight
    sizes = torch.tensor(SIZES, device=device)
    assert _grouped_gemm(backend, x, w, sizes) == _loop(x, w, sizes)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp8_grouped_gemm_k(backend, recipe, device):
    torch.manual_seed(0)
    x, dy = torch.randn(sum(SIZES), 6, device=device), torch.randn(sum(SIZES), 4, device=device)
    dy[4, 1] = float("nan")  # a row of expert 1
    sizes = torch.tensor(SIZES, device=device)
    block = (128, 1) if recipe == "blockwise" else (128, 128)
    a = K.fp8_quantize(x, recipe, dim=-2, block=block, group_sizes=sizes)
    b = K.fp8_quantize(dy, recipe, dim=-2, block=(128, 128), group_sizes=sizes)
    out = K.fp8_grouped_gemm_k(*a, *b, sizes, recipe, torch.float32, backend=backend)
    assert _nan_map(out) == [False, True, False]
