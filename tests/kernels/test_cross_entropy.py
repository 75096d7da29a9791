"""cross_entropy and fused_linear_cross_entropy against the reference, forward and backward,
and the fused op's memory bound."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import d9d.kernels as K
from d9d.errors import KernelInputError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Leading shape and vocab; 3000 spans several vocab blocks of the interpreter (1024 wide).
CE_SHAPES = [((3, 7), 1000), ((1, 1), 4096), ((5, 123), 123), ((2, 3), 3000)]


def _labels(shape, vocab, device):
    labels = torch.randint(0, vocab, shape, device=device)
    labels.view(-1)[1::4] = -100  # every fourth token ignored, from the second
    return labels


def _ce(backend, logits, labels):
    logits = logits.detach().requires_grad_()
    loss = K.cross_entropy(logits, labels, backend=backend)
    (2.5 * loss).backward()
    return loss.detach(), logits.grad


def test_reference_matches_torch():
    logits, labels = torch.randn(6, 11, dtype=torch.float64), torch.tensor([1, 2, -100, 4, 5, 0])
    expected = torch.nn.functional.cross_entropy(logits, labels)
    torch.testing.assert_close(K.cross_entropy(logits, labels, backend="reference"), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("lead", "vocab"), CE_SHAPES, ids=str)
def test_cross_entropy_triton(lead, vocab, dtype, device, assert_close):
    torch.manual_seed(0)
    logits = (4 * torch.randn(*lead, vocab, device=device)).to(dtype)
    labels = _labels(lead, vocab, device)
    loss, grad = _ce("triton", logits, labels)
    ref_loss, ref_grad = _ce("reference", logits, labels)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert_close(loss, ref_loss, torch.float32 if dtype == torch.float32 else torch.float16)
    assert_close(grad, ref_grad, dtype)


def test_cross_entropy_strided_logits_and_int32_labels(device, assert_close):
    torch.manual_seed(0)
    shifted = torch.randn(2, 9, 300, device=device)[:, :-1]  # [2, 8, 300], rows strided
    by_vocab = torch.randn(300, 16, device=device).T  # [16, 300], vocab strided
    for logits in (shifted, by_vocab):
        labels = _labels(logits.shape[:-1], 300, device).to(torch.int32)
        got = _ce("triton", logits, labels)
        ref = _ce("reference", logits.contiguous(), labels)
        for actual, expected in zip(got, ref, strict=True):
            assert_close(actual, expected, torch.float32)


def test_cross_entropy_masked_vocab_prefix_is_finite(device, assert_close):
    """-inf logits filling the first vocab blocks (1024 wide in the interpreter, 4096 on a
    GPU): the online softmax's running max stays -inf there, which must not make NaN."""
    torch.manual_seed(0)
    logits = torch.randn(4, 5000, device=device)
    logits[:3, :4500] = float("-inf")  # rows 0-2 masked past a GPU block; row 3 not
    logits[1, 17] = 2.0  # an unmasked logit before the masked run's end
    labels = torch.tensor([4600, 17, -100, 3], device=device)
    got = _ce("triton", logits, labels)
    ref = _ce("reference", logits, labels)
    assert got[0].isfinite() and got[1].isfinite().all()
    for actual, expected in zip(got, ref, strict=True):
        assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_cross_entropy_all_ignored_is_nan_with_zero_grads(backend, device):
    logits, labels = torch.randn(3, 10, device=device), torch.full((3,), -100, device=device)
    loss, grad = _ce(backend, logits, labels)
    assert loss.isnan()
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("backend", ["triton", "chunked", "reference"])
def test_fused_linear_cross_entropy_all_ignored_is_nan_with_zero_grads(backend, device):
    """As torch's mean over no token: NaN, with zero grads (not 0 * inf)."""
    hidden, weight = torch.randn(5, 8, device=device), torch.randn(20, 8, device=device)
    loss, *grads = _flce(backend, hidden, weight, torch.full((5,), -100, device=device), 2)
    assert loss.isnan()
    for grad in grads:
        assert torch.equal(grad, torch.zeros_like(grad))


def test_cross_entropy_label_out_of_range_is_nan_on_triton(device):
    logits, labels = torch.randn(3, 10, device=device), torch.tensor([1, 10, 2], device=device)
    assert K.cross_entropy(logits, labels, backend="triton").isnan()


def _flce(backend, hidden, weight, labels, chunk_size):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = K.fused_linear_cross_entropy(
        hidden, weight, labels, chunk_size=chunk_size, backend=backend
    )
    (3.0 * loss).backward()
    return loss.detach(), hidden.grad, weight.grad


# (leading shape, hidden, vocab, chunk_size): chunks that do and do not divide the tokens.
FLCE_CASES = [((3, 7), 40, 1000, 8), ((1, 1), 64, 4096, 16), ((5, 123), 24, 123, 128)]


@pytest.mark.parametrize("backend", ["triton", "chunked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FLCE_CASES, ids=str)
def test_fused_linear_cross_entropy(case, dtype, backend, device, assert_close):
    torch.manual_seed(0)
    lead, hidden_size, vocab, chunk_size = case
    hidden = torch.randn(*lead, hidden_size, device=device).to(dtype)
    weight = (torch.randn(vocab, hidden_size, device=device) / hidden_size**0.5).to(dtype)
    labels = _labels(lead, vocab, device)
    got = _flce(backend, hidden, weight, labels, chunk_size)
    ref = _flce("reference", hidden, weight, labels, chunk_size)
    assert_close(got[0], ref[0], torch.float32 if dtype == torch.float32 else torch.float16)
    for actual, expected in zip(got[1:], ref[1:], strict=True):
        assert_close(actual, expected, dtype)


def test_fused_linear_cross_entropy_chunked_computes_float64_in_float64():
    torch.manual_seed(0)
    hidden = torch.randn(5, 7, 24, dtype=torch.float64)
    weight = torch.randn(123, 24, dtype=torch.float64) / 24**0.5
    labels = _labels((5, 7), 123, "cpu")
    got = _flce("chunked", hidden, weight, labels, 8)
    ref = _flce("reference", hidden, weight, labels, 8)
    assert got[0].dtype == torch.float64
    for actual, expected in zip(got, ref, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", ["triton", "chunked"])
def test_fused_linear_cross_entropy_without_grad(backend, device, assert_close):
    hidden, weight = torch.randn(10, 8, device=device), torch.randn(50, 8, device=device)
    labels = _labels((10,), 50, device)
    with torch.no_grad():
        loss = K.fused_linear_cross_entropy(hidden, weight, labels, chunk_size=3, backend=backend)
    expected = K.fused_linear_cross_entropy(hidden, weight, labels, backend="reference")
    assert_close(loss, expected, torch.float32)


def test_fused_linear_cross_entropy_second_backward_is_refused(device):
    hidden = torch.randn(4, 8, device=device, requires_grad=True)
    weight = torch.randn(20, 8, device=device)
    loss = K.fused_linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 3, 4], device=device))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _largest_allocation(fn) -> int:
    """Bytes of the largest allocation a single torch op makes while ``fn`` runs (on CPU)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(event.self_cpu_memory_usage for event in prof.events())


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                torch.cuda.is_available(),
                reason="counts CPU allocations: Triton on CPU needs "
                "the interpreter, which a machine with CUDA does not use",
            ),
        ),
        "chunked",
    ],
)
def test_fused_linear_cross_entropy_never_holds_all_logits(backend):
    tokens, hidden_size, vocab, chunk_size = 512, 8, 256, 32
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))

    def step(name: str, chunk: int):
        def run():
            K.fused_linear_cross_entropy(
                hidden, weight, labels, chunk_size=chunk, backend=name
            ).backward()

        return run

    full = tokens * vocab * 4
    assert _largest_allocation(step("reference", chunk_size)) >= full
    # One float32 chunk of logits: 16x below the full logits here.
    assert _largest_allocation(step(backend, chunk_size)) <= chunk_size * vocab * 4
    assert _largest_allocation(step(backend, 2 * chunk_size)) <= 2 * chunk_size * vocab * 4


class _LargeResults(TorchDispatchMode):
    """Records the ops that return a new tensor of at least ``numel`` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in [*args, *(kwargs or {}).values()] if isinstance(a, torch.Tensor)]
        storages = {a.untyped_storage().data_ptr() for a in inputs}
        results = out if isinstance(out, tuple | list) else [out]
        if any(
            isinstance(r, torch.Tensor)
            and r.numel() >= self.numel
            and r.untyped_storage().data_ptr() not in storages  # not a view or in place
            for r in results
        ):
            self.ops.append(str(func))
        return out


def test_fused_linear_cross_entropy_backward_allocates_no_gradient_sized_buffer():
    """The backward only scales the gradients the forward computed: autograd must not hand
    it zero gradients for the op's gradient outputs (a [vocab, hidden] buffer each step).
    The autograd glue is the same for every backend; "chunked" runs on any machine."""
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(500, 8, requires_grad=True)
    labels = torch.randint(0, 500, (64,))
    loss = K.fused_linear_cross_entropy(hidden, weight, labels, chunk_size=16, backend="chunked")
    large = _LargeResults(hidden.numel())
    with large:
        loss.backward()
    assert large.ops == []
    assert weight.grad is not None and hidden.grad is not None


def test_errors():
    logits = torch.randn(2, 5)
    with pytest.raises(KernelInputError, match=r"labels must be an integer tensor, got torch.fl"):
        K.cross_entropy(logits, torch.zeros(2))
    with pytest.raises(KernelInputError, match=r"labels must be an integer tensor, got torch.bool"):
        K.cross_entropy(logits, torch.zeros(2, dtype=torch.bool))
    with pytest.raises(KernelInputError, match=r"labels.shape=\(3,\), expected \(2,\)"):
        K.cross_entropy(logits, torch.zeros(3, dtype=torch.long))
    with pytest.raises(KernelInputError, match=r"logits must be \[..., vocab\]"):
        K.cross_entropy(torch.tensor(1.0), torch.tensor(0))
    hidden, weight, labels = torch.randn(4, 8), torch.randn(20, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(KernelInputError, match=r"weight \[vocab, hidden\], got"):
        K.fused_linear_cross_entropy(hidden, weight.T, labels)
    with pytest.raises(KernelInputError, match=r"chunk_size=0 must be a positive int"):
        K.fused_linear_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(
        KernelInputError, match=r"hidden.dtype=torch.float32, weight.dtype=torch.bf"
    ):
        K.fused_linear_cross_entropy(hidden, weight.bfloat16(), labels)


@pytest.mark.parametrize("backend", ["triton", "chunked"])
def test_fused_linear_cross_entropy_frozen_head(backend, device, assert_close):
    torch.manual_seed(0)
    hidden, weight = torch.randn(10, 8, device=device), torch.randn(50, 8, device=device)
    labels = _labels((10,), 50, device)
    grads = []
    for name in (backend, "reference"):
        leaf = hidden.detach().requires_grad_()
        K.fused_linear_cross_entropy(leaf, weight, labels, chunk_size=4, backend=name).backward()
        grads.append(leaf.grad)
    assert_close(grads[0], grads[1], torch.float32)
    assert weight.grad is None
