"""grouped_gemm: every backend against the reference, forward and backward; the reference
against a plain per-expert loop in float64; the custom ops' fake and autograd registrations."""

from __future__ import annotations

import pytest
import torch

import d9d.kernels as K
from d9d.errors import KernelInputError
from d9d.kernels import _grouped_gemm

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16]
# (T, K, N, group sizes): odd token counts, E not a power of two, empty experts, every row
# on one expert, K and N not multiples of 16 bytes (torch._grouped_mm pads them), T = 0.
CASES = {
    "uneven": (37, 24, 40, [9, 0, 13, 0, 15]),
    "one-expert": (37, 17, 9, [0, 0, 0, 37, 0, 0, 0]),
    "no-tokens": (0, 16, 24, [0, 0, 0]),
}


def _inputs(case: str, dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    rows, k, n, sizes = CASES[case]
    x = torch.randn(rows, k, device=device).to(dtype)
    w = (torch.randn(len(sizes), k, n, device=device) * k**-0.5).to(dtype)
    upstream = torch.randn(rows, n, device=device).to(dtype)
    return x, w, torch.tensor(sizes, device=device), upstream


def _run(fn, x, w, group_sizes, upstream):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = fn(x, w, group_sizes)
    out.backward(upstream)
    return out.detach(), x.grad, w.grad


def _loop(x, w, group_sizes):
    """The obvious implementation: split the rows, one matmul per expert (syncs the host)."""
    chunks = x.split(group_sizes.tolist())
    return torch.cat([chunk @ w[e] for e, chunk in enumerate(chunks)])


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_a_loop_in_float64(case):
    x, w, group_sizes, upstream = _inputs(case, torch.float64, "cpu")
    got = _run(lambda *a: K.grouped_gemm(*a, backend="reference"), x, w, group_sizes, upstream)
    expected = _run(_loop, x, w, group_sizes, upstream)
    for actual, wanted in zip(got, expected, strict=True):
        torch.testing.assert_close(actual, wanted)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference(backend, case, dtype, device, assert_close):
    x, w, group_sizes, upstream = _inputs(case, dtype, device)
    got = _run(lambda *a: K.grouped_gemm(*a, backend=backend), x, w, group_sizes, upstream)
    ref = _run(lambda *a: K.grouped_gemm(*a, backend="reference"), x, w, group_sizes, upstream)
    for actual, expected in zip(got, ref, strict=True):
        assert_close(actual, expected, dtype)


@pytest.mark.parametrize("case", CASES)
def test_triton_reads_no_masked_lane(case, undefined_masked_lanes, assert_close):
    """Masked lanes read NaN (undefined on a GPU): output and grads equal the reference's."""
    x, w, group_sizes, upstream = _inputs(case, torch.float32, "cpu")
    got = _run(lambda *a: K.grouped_gemm(*a, backend="triton"), x, w, group_sizes, upstream)
    ref = _run(lambda *a: K.grouped_gemm(*a, backend="reference"), x, w, group_sizes, upstream)
    for actual, expected in zip(got, ref, strict=True):
        assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs_and_int32_sizes(backend, device, assert_close):
    torch.manual_seed(0)
    x = torch.randn(24, 37, device=device).t()  # [37, 24], column-major
    w = torch.randn(3, 40, 24, device=device).transpose(1, 2)  # [3, 24, 40]
    group_sizes = torch.tensor([20, 0, 17], dtype=torch.int32, device=device)
    upstream = torch.randn(37, 40, device=device)
    got = _run(lambda *a: K.grouped_gemm(*a, backend=backend), x, w, group_sizes, upstream)
    ref = _run(lambda *a: K.grouped_gemm(*a, backend="reference"), x, w, group_sizes, upstream)
    for actual, expected in zip(got, ref, strict=True):
        assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_custom_op_registrations(backend, device):
    forward = getattr(_grouped_gemm, f"_{backend}_forward")
    backward = getattr(_grouped_gemm, f"_{backend}_backward")
    x, w, group_sizes, grad = _inputs("uneven", torch.float32, device)
    torch.library.opcheck(forward, (x.requires_grad_(), w.requires_grad_(), group_sizes))
    torch.library.opcheck(backward, (grad, x.detach(), w.detach(), group_sizes))


def test_errors():
    x, w, sizes = torch.ones(4, 3), torch.ones(2, 3, 5), torch.tensor([1, 3])
    with pytest.raises(KernelInputError, match=r"x must be \[T, K\] and w \[E, K, N\]"):
        K.grouped_gemm(x, torch.ones(2, 4, 5), sizes)
    with pytest.raises(
        KernelInputError, match=r"group_sizes must be an int32 or int64 tensor of shape"
    ):
        K.grouped_gemm(x, w, torch.tensor([1.0, 3.0]))
    with pytest.raises(KernelInputError, match=r"shape \[E\]=\(2,\), got group_sizes.shape"):
        K.grouped_gemm(x, w, torch.tensor([4]))
    with pytest.raises(KernelInputError, match=r"x.dtype=torch.float32, w.dtype=torch.float64"):
        K.grouped_gemm(x, w.double(), sizes)
