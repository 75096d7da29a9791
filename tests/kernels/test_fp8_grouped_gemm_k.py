"""fp8_grouped_gemm_k: the reference against a float64 loop over experts written here (each
expert's operands quantized on its rows alone), the Triton kernel against the reference on
ragged groups, signal to quantization noise, errors and the custom op."""

from __future__ import annotations

import pytest
import torch
from test_fp8_gemm import _assert_matches_reference, _snr_db

import d9d.kernels as K
from d9d.errors import KernelInputError
from d9d.kernels import _fp8_grouped_gemm_k

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise", "blockwise")
# Experts: empty, under 128 rows, not a multiple of 16, two 128-row tiles (one ragged).
SIZES = [0, 130, 5, 0, 77, 200]


def _quantize(t: torch.Tensor, recipe: str, dtype, block, sizes=None, backend=None):
    """``t [rows, cols]`` along its rows (within experts when ``sizes`` is given)."""
    return K.fp8_quantize(t, recipe, dtype, dim=-2, block=block, group_sizes=sizes, backend=backend)


def _operands(recipe, sizes, m, n, b_dtype=E5M2, device="cpu"):
    """``x [T, m]`` (e4m3, 128x128 tiles) and ``dy [T, n]`` (``b_dtype``, 128x1 tiles), the
    weight grad's operands, quantized by expert; and the float32 originals."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(sum(sizes), m, generator=g).to(device)
    dy = torch.randn(sum(sizes), n, generator=g).to(device) * 1e-3
    group_sizes = torch.tensor(sizes, device=device)
    a = _quantize(x, recipe, E4M3, (128, 128), group_sizes)
    b = _quantize(dy, recipe, b_dtype, (128, 1), group_sizes)
    return (*a, *b, group_sizes), (x, dy)


def _wide(data: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """float64 ``data * scale`` of one expert's ``fp8_quantize`` output."""
    if scale.shape[0] > 1 or scale.shape[1] not in (1, data.shape[1]):  # blockwise tiles
        scale = scale.repeat_interleave(128, 0)[: data.shape[0]]
        scale = scale.repeat_interleave(block[1], 1)[:, : data.shape[1]]
    return data.double() * scale.double()


def _float64_loop(x, dy, sizes, recipe, b_dtype):
    """Each expert alone: its rows quantized by ``fp8_quantize`` (no group sizes), the
    product in float64."""
    out, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        a = _quantize(x[rows], recipe, E4M3, (128, 128), backend="reference")
        b = _quantize(dy[rows], recipe, b_dtype, (128, 1), backend="reference")
        out.append(_wide(*a, (128, 128)).t() @ _wide(*b, (128, 1)))
        start += n
    return torch.stack(out)


@pytest.mark.parametrize("b_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("recipe", RECIPES)
def test_reference_matches_a_float64_loop_over_experts(recipe, b_dtype):
    operands, (x, dy) = _operands(recipe, SIZES, 70, 150, b_dtype)
    got = K.fp8_grouped_gemm_k(*operands, recipe, torch.float32, backend="reference")
    want = _float64_loop(x, dy, SIZES, recipe, b_dtype)
    assert got.shape == (len(SIZES), 70, 150)
    assert torch.equal(got[0], torch.zeros(70, 150)) and torch.equal(got[3], got[0])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("recipe", RECIPES)
def test_triton_matches_reference(recipe, out_dtype, device):
    grad_dtype = E4M3 if recipe == "blockwise" else E5M2  # as fp8's recipes use them
    for sizes, m, n in ((SIZES, 70, 150), ([0, 0], 16, 24), ([3], 1, 130)):
        operands, (x, dy) = _operands(recipe, sizes, m, n, grad_dtype, device)
        got = K.fp8_grouped_gemm_k(*operands, recipe, out_dtype, backend="triton")
        want = K.fp8_grouped_gemm_k(*operands, recipe, out_dtype, backend="reference")
        if not sum(sizes):  # experts without rows: zeros
            assert torch.equal(got, torch.zeros_like(want))
            continue
        gemm = K.fp8_grouped_gemm_k
        _assert_matches_reference(got, want, operands, recipe, out_dtype, gemm=gemm)
        rows = torch.arange(x.shape[0], device=device).split(sizes)
        exact = torch.stack([x[r].t() @ dy[r] for r in rows])
        assert _snr_db(got.float(), exact) >= 17  # issue 28's weight grads (dy in e5m2: ~24 dB)


def test_errors():
    (a, a_scale, b, b_scale, sizes), _ = _operands("blockwise", [3, 5], 32, 16)
    with pytest.raises(KernelInputError, match=r"share their rows \(the tokens\)"):
        K.fp8_grouped_gemm_k(a[:7], a_scale, b, b_scale, sizes, "blockwise")
    with pytest.raises(KernelInputError, match=r"a_scale.shape=\(2, 1\), expected one of"):
        K.fp8_grouped_gemm_k(a, a_scale[:2], b, b_scale, sizes, "blockwise")
    with pytest.raises(KernelInputError, match=r"group_sizes must be an \[E\] int32 or int64"):
        K.fp8_grouped_gemm_k(a, a_scale, b, b_scale, sizes.float(), "blockwise")
    with pytest.raises(KernelInputError, match=r"b_data must be a \[T, cols\] float8"):
        K.fp8_grouped_gemm_k(a, a_scale, b.float(), b_scale, sizes, "blockwise")
    with pytest.raises(KernelInputError, match=r"unknown recipe='mxfp8'"):
        K.fp8_grouped_gemm_k(a, a_scale, b, b_scale, sizes, "mxfp8")


# opcheck's schema test multiplies the inputs, which torch does not implement for fp8.
CHECKS = ("test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_custom_op_registration(recipe, device):
    operands, _ = _operands(recipe, [9, 0, 4], 40, 24, device=device)
    args = (*operands, recipe, torch.float32)
    torch.library.opcheck(_fp8_grouped_gemm_k._triton, args, test_utils=CHECKS)
