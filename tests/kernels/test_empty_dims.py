"""A dim of size 0 where the op allows one: each backend's output and grads are the
reference's (empty, or zeros), not an error from inside the backend."""

from __future__ import annotations

import pytest
import torch

import d9d.kernels as K
from d9d.errors import KernelInputError


def _run(fn, tensors, backend):
    """``(output, grads)`` of ``fn(*tensors, backend=...)`` with every float tensor a leaf."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*leaves, backend=backend)
    outputs = out if isinstance(out, tuple) else (out,)
    total = sum(o.sum() for o in outputs)
    total.backward()
    return [o.detach() for o in outputs], [t.grad for t in leaves if t.is_floating_point()]


def _assert_same(fn, tensors, backend):
    got, got_grads = _run(fn, tensors, backend)
    ref, ref_grads = _run(fn, tensors, "reference")
    for actual, expected in zip(got + got_grads, ref + ref_grads, strict=True):
        torch.testing.assert_close(actual, expected)


def test_rms_norm_triton_hidden_0(device):
    x, w = torch.randn(3, 0, device=device), torch.randn(0, device=device)
    _assert_same(lambda x, w, backend: K.rms_norm(x, w, backend=backend), [x, w], "triton")
    fused = lambda x, r, w, backend: K.fused_add_rms_norm(x, r, w, backend=backend)  # noqa: E731
    _assert_same(fused, [x, torch.randn(3, 0, device=device), w], "triton")


def test_rope_triton_head_dim_0(device):
    q, k = torch.randn(2, 3, 2, 0, device=device), torch.randn(2, 3, 1, 0, device=device)
    table = torch.randn(3, 0, device=device)
    rope = lambda q, k, backend: K.rope(q, k, table, table, backend=backend)  # noqa: E731
    _assert_same(rope, [q, k], "triton")


@pytest.mark.parametrize(("k", "n"), [(0, 5), (4, 0)], ids=["K=0", "N=0"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_grouped_gemm_empty_k_or_n(backend, k, n, device):
    x, w = torch.randn(7, k, device=device), torch.randn(2, k, n, device=device)
    sizes = torch.tensor([3, 4], device=device)
    gemm = lambda x, w, backend: K.grouped_gemm(x, w, sizes, backend=backend)  # noqa: E731
    _assert_same(gemm, [x, w], backend)


@pytest.mark.parametrize(("top_k", "hidden"), [(0, 4), (2, 0)], ids=["top_k=0", "H=0"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_moe_unpermute_empty_top_k_or_hidden(backend, top_k, hidden, device):
    row_map = torch.randperm(5 * top_k, device=device).view(5, top_k)
    outputs = torch.randn(5 * top_k, hidden, device=device)
    weights = torch.rand(5, top_k, device=device)
    unpermute = lambda y, r, w, backend: K.moe_unpermute(y, r, w, backend=backend)  # noqa: E731
    _assert_same(unpermute, [outputs, row_map, weights], backend)


@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_fused_linear_cross_entropy_hidden_0(backend, device):
    hidden, weight = torch.randn(3, 0, device=device), torch.randn(5, 0, device=device)
    labels = torch.tensor([1, -100, 4], device=device)
    loss = lambda h, w, backend: K.fused_linear_cross_entropy(h, w, labels, backend=backend)  # noqa: E731
    _assert_same(loss, [hidden, weight], backend)


def test_an_empty_vocab_is_refused_by_name(device):
    """Refused before a backend is chosen, so for every backend."""
    labels = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(KernelInputError, match=r"logits.shape=torch.Size\(\[3, 0\]\) has an emp"):
        K.cross_entropy(torch.randn(3, 0, device=device), labels)
    hidden, weight = torch.randn(3, 4, device=device), torch.randn(0, 4, device=device)
    with pytest.raises(KernelInputError, match=r"weight.shape=torch.Size\(\[0, 4\]\) has an emp"):
        K.fused_linear_cross_entropy(hidden, weight, labels)
