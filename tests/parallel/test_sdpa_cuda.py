"""The CUDA SDPA block attentions (flash, memory-efficient): wired to the kernels' schemas
(on meta tensors, any machine) and equal to the math version (on a GPU)."""

from __future__ import annotations

import pytest
import torch

from d9d import kernels
from d9d.errors import KernelUnavailableError
from d9d.kernels._registry import resolve
from d9d.parallel import MATH_BLOCK_ATTENTION
from d9d.parallel._sdpa_block_attention import (
    SDPA_EFFICIENT_BLOCK_ATTENTION,
    SDPA_FLASH_BLOCK_ATTENTION,
)

# Odd sizes: 6 query heads on 2 K/V heads, head sizes 20 (Q, K) and 12 (V), neither a
# multiple of 8; 37 query rows, not a multiple of the efficient kernel's 32.
CASES = [(37, 37, True), (21, 50, False)]
BACKENDS = {
    "sdpa_flash": (SDPA_FLASH_BLOCK_ATTENTION, [torch.bfloat16, torch.float16]),
    "sdpa_efficient": (SDPA_EFFICIENT_BLOCK_ATTENTION, [torch.float32, torch.bfloat16]),
}
PAIRS = [(name, dtype) for name, (_, dtypes) in BACKENDS.items() for dtype in dtypes]


def _inputs(seq_q, seq_k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, 6, seq_q, 20), (2, 2, seq_k, 20), (2, 2, seq_k, 12), (2, 6, seq_q, 12)]
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]


@pytest.mark.parametrize(("seq_q", "seq_k", "causal"), CASES)
@pytest.mark.parametrize(("name", "dtype"), PAIRS)
def test_kernel_calls_match_their_schemas_on_meta_tensors(name, dtype, seq_q, seq_k, causal):
    """The arguments reach the aten kernels in schema order and the outputs keep the block
    contract: out [B, H, Sq, Dv] and lse [B, H, Sq] forward; dq, dk, dv like q, k, v."""
    block = BACKENDS[name][0]
    q, k, v, dout = _inputs(seq_q, seq_k, dtype, "meta")
    out, lse = block.forward(q, k, v, scale=0.3, causal=causal)
    assert (out.shape, lse.shape) == ((2, 6, seq_q, 12), (2, 6, seq_q))
    assert out.dtype == lse.dtype == torch.float32
    grads = block.backward(q, k, v, out, dout.float(), lse, scale=0.3, causal=causal)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(g.dtype == torch.float32 for g in grads)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", list(BACKENDS))
def test_forcing_a_cuda_backend_without_cuda_says_why(name):
    with kernels.use(block_attention=name), pytest.raises(KernelUnavailableError, match="CUDA"):
        resolve("block_attention", torch.ones(1, 2, 4, 8, dtype=torch.bfloat16), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("seq_q", "seq_k", "causal"), CASES)
@pytest.mark.parametrize(("name", "dtype"), PAIRS)
def test_equals_the_math_block_on_cuda(name, dtype, seq_q, seq_k, causal):
    """Forward (output, log-sum-exp) and backward from the final output and log-sum-exp,
    against the math version in float32 on the same (rounded) inputs."""
    block = BACKENDS[name][0]
    q, k, v, dout = _inputs(seq_q, seq_k, dtype, "cuda")
    options = {"scale": 0.3, "causal": causal}
    want = MATH_BLOCK_ATTENTION.forward(q.float(), k.float(), v.float(), **options)
    got = block.forward(q, k, v, **options)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    out, lse = want
    want = MATH_BLOCK_ATTENTION.backward(
        q.float(), k.float(), v.float(), out, dout.float(), lse, **options
    )
    got = block.backward(q, k, v, out, dout.float(), lse, **options)
    torch.testing.assert_close(got, want, **tol)
