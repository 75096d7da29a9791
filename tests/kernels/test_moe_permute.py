"""moe_permute / moe_unpermute: the routing they produce, every backend against the
reference forward and backward, and one fullgraph compile of permute -> grouped GEMM ->
unpermute with no graph break."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import d9d.kernels as K
from d9d.errors import KernelInputError
from d9d.kernels import _moe_permute

DTYPES = [torch.float32, torch.bfloat16]
# (T, H, E, top_k, experts the tokens may choose): odd T, E not a power of two, skewed
# routing (all tokens on one expert; several experts empty), T = 0.
CASES = {
    "top1-all-to-one": (37, 24, 5, 1, [3]),
    "top2-skewed": (37, 40, 7, 2, [1, 4]),
    "top8": (37, 9, 11, 8, list(range(11))),
    "no-tokens": (0, 8, 3, 2, [0, 2]),
}


def _inputs(case: str, dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    tokens, hidden, experts, top_k, allowed = CASES[case]
    allowed = torch.tensor(allowed)
    picks = [allowed[torch.randperm(len(allowed))[:top_k]] for _ in range(tokens)]
    ids = torch.stack(picks) if tokens else torch.zeros(0, top_k, dtype=torch.long)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    weights = torch.rand(tokens, top_k, device=device)  # float32 routing weights
    permuted_grad = torch.randn(tokens * top_k, hidden, device=device).to(dtype)
    out_grad = torch.randn(tokens, hidden, device=device).to(dtype)
    return x, ids.to(device), experts, weights, permuted_grad, out_grad


# A backend name of the tests -> (moe_permute's backend, moe_unpermute's backend):
# "torch" is an unpermute backend only.
PERMUTE_UNPERMUTE = {
    "reference": ("reference", "reference"),
    "triton": ("triton", "triton"),
    "torch": ("reference", "torch"),
}


def _round_trip(backend, x, ids, experts, weights, permuted_grad, out_grad):
    """Permute forward and backward; unpermute of ``permuted_grad`` forward and backward."""
    permute_backend, unpermute_backend = PERMUTE_UNPERMUTE[backend]
    x = x.detach().requires_grad_()
    permuted, group_sizes, row_map = K.moe_permute(x, ids, experts, backend=permute_backend)
    permuted.backward(permuted_grad)
    expert_out = permuted_grad.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    out = K.moe_unpermute(expert_out, row_map, weights, backend=unpermute_backend)
    out.backward(out_grad)
    return (
        permuted.detach(),
        group_sizes,
        row_map,
        x.grad,
        out.detach(),
        expert_out.grad,
        weights.grad,
    )


@pytest.mark.parametrize("case", CASES)
def test_routing_groups_rows_by_expert(case):
    x, ids, experts, weights, _, _ = _inputs(case, torch.float64, "cpu")
    permuted, group_sizes, row_map = K.moe_permute(x, ids, experts, backend="reference")
    assert group_sizes.dtype == torch.int32 and row_map.shape == ids.shape
    assert group_sizes.tolist() == torch.bincount(ids.flatten(), minlength=experts).tolist()
    row_expert = torch.empty(ids.numel(), dtype=torch.long)
    row_expert[row_map.flatten()] = ids.flatten()
    assert torch.equal(row_expert, row_expert.sort().values)  # grouped, experts in order
    for t, j in ((t, j) for t in range(ids.shape[0]) for j in range(ids.shape[1])):
        assert torch.equal(permuted[row_map[t, j]], x[t])
    out = K.moe_unpermute(permuted, row_map, weights.double(), backend="reference")
    torch.testing.assert_close(out, x * weights.double().sum(1, keepdim=True))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_backend_matches_reference(case, dtype, backend, device, assert_close):
    inputs = _inputs(case, dtype, device)
    got = _round_trip(backend, *inputs)
    ref = _round_trip("reference", *inputs)
    for actual, expected in zip(got, ref, strict=True):
        if actual.is_floating_point():
            assert_close(actual, expected, actual.dtype)
        else:
            assert torch.equal(actual, expected)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_non_contiguous_inputs(backend, device, assert_close):
    x, ids, experts, weights, permuted_grad, out_grad = _inputs(
        "top2-skewed", torch.float32, device
    )
    x = torch.cat([x, x], dim=1)[:, ::2]  # stride 2 along H
    weights = torch.cat([weights, weights], dim=1)[:, ::2]
    got = _round_trip(backend, x, ids, experts, weights, permuted_grad, out_grad)
    ref = _round_trip("reference", x, ids, experts, weights, permuted_grad, out_grad)
    for actual, expected in zip(got[3:], ref[3:], strict=True):  # grad of x, out and its grads
        assert_close(actual, expected, torch.float32)
    assert_close(got[0], ref[0], torch.float32)


@pytest.mark.parametrize("case", CASES)
def test_triton_reads_no_masked_lane(case, undefined_masked_lanes, assert_close):
    """Masked lanes read NaN (undefined on a GPU): the results equal the reference's. The
    weights' grad (choice_dot) summed the lanes past H of its power-of-two tile, NaN here."""
    inputs = _inputs(case, torch.float32, "cpu")
    got = _round_trip("triton", *inputs)
    for actual, expected in zip(got, _round_trip("reference", *inputs), strict=True):
        if actual.is_floating_point():
            assert_close(actual, expected, actual.dtype)
        else:
            assert torch.equal(actual, expected)


def test_custom_op_registrations(device):
    x, ids, experts, weights, permuted_grad, _ = _inputs("top2-skewed", torch.float32, device)
    row_map, _ = _moe_permute.route(ids, experts)
    for op, args in (
        (_moe_permute._scatter, (x.requires_grad_(), row_map, weights.requires_grad_())),
        (_moe_permute._gather_sum, (permuted_grad.requires_grad_(), row_map, weights)),
        (_moe_permute._choice_dot, (x.detach(), permuted_grad.detach(), row_map, weights.detach())),
    ):
        torch.library.opcheck(op, args)


def _moe(x, ids, weights, w_up, w_down, backend):
    """A dropless MoE MLP body: permute, two grouped GEMMs, unpermute."""
    permute_backend, unpermute_backend = PERMUTE_UNPERMUTE[backend]
    gemm = "reference" if backend == "reference" else "torch"
    permuted, group_sizes, row_map = K.moe_permute(x, ids, w_up.shape[0], backend=permute_backend)
    hidden = torch.relu(K.grouped_gemm(permuted, w_up, group_sizes, backend=gemm))
    out = K.grouped_gemm(hidden, w_down, group_sizes, backend=backend)
    return K.moe_unpermute(out, row_map, weights, backend=unpermute_backend).square().sum()


@pytest.mark.compile
@pytest.mark.parametrize("backend", ["reference", "triton", "torch"])
def test_moe_compiles_without_graph_breaks(backend, device):
    torch._dynamo.reset()
    counters.clear()
    x, ids, experts, weights, _, _ = _inputs("top2-skewed", torch.float32, device)
    w_up = torch.randn(experts, 40, 24, device=device) * 0.2
    w_down = torch.randn(experts, 24, 40, device=device) * 0.2

    def loss_and_grads(fn):
        leaves = [t.detach().requires_grad_() for t in (x, weights, w_up, w_down)]
        loss = fn(leaves[0], ids, *leaves[1:], backend)
        loss.backward()
        return [loss.detach()] + [t.grad for t in leaves]

    got = loss_and_grads(torch.compile(_moe, backend="aot_eager", fullgraph=True))
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    for actual, expected in zip(got, loss_and_grads(_moe), strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA notion")
@pytest.mark.parametrize("backend", ["reference", "triton", "torch"])
def test_moe_does_not_sync_the_host(backend):
    x, ids, experts, weights, _, _ = _inputs("top2-skewed", torch.bfloat16, "cuda")
    w_up = torch.randn(experts, 40, 24, device="cuda", dtype=torch.bfloat16)
    w_down = torch.randn(experts, 24, 40, device="cuda", dtype=torch.bfloat16)
    leaves = [t.requires_grad_() for t in (x, weights, w_up, w_down)]
    _moe(leaves[0], ids, *leaves[1:], backend)  # warm-up: Triton compiles, caches fill
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _moe(leaves[0], ids, *leaves[1:], backend).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_errors():
    x, ids = torch.ones(4, 3), torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(
        KernelInputError, match=r"expert_ids must be an int32 or int64 tensor \[T, top_k\]"
    ):
        K.moe_permute(x, ids.float(), 2)
    with pytest.raises(KernelInputError, match=r"x must be \[T, H\] and expert_ids \[T, top_k\]"):
        K.moe_permute(x, ids[:3], 2)
    with pytest.raises(KernelInputError, match=r"num_experts=0 must be a positive int"):
        K.moe_permute(x, ids, 0)
    with pytest.raises(KernelInputError, match=r"permuted_out must be \[T\*top_k, H\]"):
        K.moe_unpermute(torch.ones(7, 3), ids, torch.ones(4, 2))
    with pytest.raises(KernelInputError, match=r"weights must be a floating-point tensor"):
        K.moe_unpermute(torch.ones(8, 3), ids, ids)
