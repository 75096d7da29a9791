"""torch.compile(fullgraph=True) traces every op, reference and Triton, with no graph break."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import d9d.kernels as K

pytestmark = pytest.mark.compile


def _block(x, residual, norm, w_gate, w_up, w_down, q, k, cos, sin, head, labels, backend):
    """A Llama-shaped block and head: every op but adamw."""
    normed, residual = K.fused_add_rms_norm(x, residual, norm, backend=backend)
    q, k = K.rope(q, k, cos, sin, backend=backend)
    mlp = K.swiglu(normed @ w_gate, normed @ w_up, backend=backend) @ w_down
    out = K.rms_norm(mlp + residual, norm, 1e-5, backend=backend)
    loss = K.cross_entropy(out @ head.T, labels, backend=backend)
    flce = "chunked" if backend == "reference" else backend
    loss = loss + K.fused_linear_cross_entropy(out, head, labels, chunk_size=4, backend=flce)
    return loss + (q.square().sum() + k.square().sum()) * 1e-3


def _inputs(device):
    torch.manual_seed(0)
    dim, ffn, vocab = 16, 24, 40
    tensors = [
        torch.randn(2, 5, dim),
        torch.randn(2, 5, dim),
        torch.randn(dim),
        torch.randn(dim, ffn),
        torch.randn(dim, ffn),
        torch.randn(ffn, dim),
        torch.randn(2, 5, 4, 8),
        torch.randn(2, 5, 2, 8),
        torch.randn(5, 8),
        torch.randn(5, 8),
        torch.randn(vocab, dim),
    ]
    tensors = [t.to(device).requires_grad_(i not in (8, 9)) for i, t in enumerate(tensors)]
    return [*tensors, torch.randint(0, vocab, (2, 5), device=device)]


def _loss_and_grads(fn, inputs, backend):
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
    loss = fn(*leaves, backend)
    loss.backward()
    return [loss.detach()] + [t.grad for t in leaves if t.grad is not None]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_block_compiles_without_graph_breaks(backend, device):
    torch._dynamo.reset()
    counters.clear()
    inputs = _inputs(device)
    compiled = torch.compile(_block, backend="aot_eager", fullgraph=True)
    got = _loss_and_grads(compiled, inputs, backend)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    expected = _loss_and_grads(_block, inputs, backend)
    for actual, wanted in zip(got, expected, strict=True):
        torch.testing.assert_close(actual, wanted, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_adamw_compiles_without_graph_breaks(backend, device):
    torch._dynamo.reset()
    counters.clear()

    def update(params, grads, exp_avgs, exp_avg_sqs, lr, step):
        K.adamw(params, grads, exp_avgs, exp_avg_sqs, lr=lr, step=step, backend=backend)

    def state():
        torch.manual_seed(0)
        params, grads, exp_avgs, exp_avg_sqs = (torch.randn(3, 4, device=device) for _ in "pgmv")
        return [params], [grads], [exp_avgs], [exp_avg_sqs.abs()]

    compiled_state, eager_state = state(), state()
    lr, step = torch.tensor(0.1, device=device), torch.tensor(1.0, device=device)
    torch.compile(update, backend="aot_eager", fullgraph=True)(*compiled_state, lr, step)
    update(*eager_state, lr, step)
    assert dict(counters["graph_break"]) == {}
    for compiled, eager in zip(compiled_state, eager_state, strict=True):
        torch.testing.assert_close(compiled, eager)


def _fp8_matmuls(x, w, experts, group_sizes, recipe, backend):
    """fp8 quantize, then a dense, a grouped and a grouped-along-K fp8 GEMM (the last on
    operands quantized by expert), every recipe's layouts."""
    x_data, x_scale = K.fp8_quantize(x, recipe, backend=backend)
    w_data, w_scale = K.fp8_quantize(w, recipe, dim=-2, block=(128, 128), backend=backend)
    e_data, e_scale = K.fp8_quantize(experts, recipe, dim=-2, block=(128, 128), backend=backend)
    gemm = "reference" if backend == "reference" else "triton"
    dense = K.fp8_gemm(x_data, x_scale, w_data, w_scale, recipe, torch.float32, backend=gemm)
    grouped = K.fp8_grouped_gemm(
        x_data, x_scale, e_data, e_scale, group_sizes, recipe, torch.float32, backend=gemm
    )
    by_expert = {"dim": -2, "group_sizes": group_sizes, "backend": backend}
    a = K.fp8_quantize(x, recipe, block=(128, 128), **by_expert)
    b = K.fp8_quantize(dense, recipe, block=(128, 1), **by_expert)
    weight = K.fp8_grouped_gemm_k(*a, *b, group_sizes, recipe, torch.float32, backend=gemm)
    return dense, grouped, weight


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_fp8_ops_compile_without_graph_breaks(recipe, backend, device):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    x, w = torch.randn(9, 130, device=device), torch.randn(130, 24, device=device)
    experts = torch.randn(2, 130, 24, device=device)
    group_sizes = torch.tensor([4, 5], device=device)
    args = (x, w, experts, group_sizes, recipe, backend)
    compiled = torch.compile(_fp8_matmuls, backend="aot_eager", fullgraph=True)(*args)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    for got, want in zip(compiled, _fp8_matmuls(*args), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
