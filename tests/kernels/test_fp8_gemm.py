"""fp8_gemm and fp8_grouped_gemm: the references against block loops written here and against
float32 matmuls (signal to quantization noise), every backend against the reference on
ragged shapes, the layouts a linear layer passes, errors, and the custom ops."""

from __future__ import annotations

import pytest
import torch

import d9d.kernels as K
from d9d.errors import KernelInputError, KernelUnavailableError
from d9d.kernels import _fp8_gemm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise", "blockwise")
OUT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3}  # reduction order; one bf16 rounding
# On a GPU the products are summed by fp8 tensor cores, whose accumulator keeps fewer bits than
# float32 (about 14 on Hopper, DeepSeek-V3 measured) until a 128-deep partial reaches float32:
# four MMAs of 32, each rounding by up to 2**-13 of the partial's sum of |products|. On CPU the
# Triton interpreter upcasts and every backend sums in float32: only the order differs.
TENSOR_CORE_ROUNDING = 4 * 2.0**-13


def _assert_matches_reference(got, want, operands, recipe, out_dtype=torch.float32, gemm=None):
    """``|got - want| <= tol * (max|want| + |want|)``, plus the tensor cores' rounding of the
    sum of |products| (the reference ``gemm`` applied to ``|a|`` and ``|b|``; by default
    ``fp8_grouped_gemm`` or ``fp8_gemm`` as ``operands`` have group sizes or not) when ``got``
    is on CUDA."""
    assert got.dtype == want.dtype == out_dtype and got.shape == want.shape
    if not want.numel():
        return
    tol = OUT_TOLERANCE[out_dtype]
    err, want = (got.float() - want.float()).abs(), want.float()
    bound = tol * (want.abs().max() + want.abs())
    if got.is_cuda:
        a, a_scale, b, b_scale, *group_sizes = operands
        magnitude_operands = (_abs(a), a_scale, _abs(b), b_scale, *group_sizes)
        gemm = gemm or (K.fp8_grouped_gemm if group_sizes else K.fp8_gemm)
        magnitude = gemm(*magnitude_operands, recipe, torch.float32, backend="reference")
        bound = bound + TENSOR_CORE_ROUNDING * magnitude
    worst = (err / bound).max().item()
    assert worst <= 1, f"error up to {worst:.3g}x the bound, {err.max().item():.3g} at most"


def _abs(data: torch.Tensor) -> torch.Tensor:
    """|data| of fp8 data, exact (a sign bit), in its layout."""
    return data.view(torch.uint8).bitwise_and(0x7F).view(data.dtype)


def _operands(m: int, k: int, n: int, recipe: str, device: str = "cpu", b_dtype=E4M3):
    """``a [m, k]`` and ``b [k, n]`` quantized along K, and the float32 originals."""
    torch.manual_seed(0)
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device) * k**-0.5
    a_data, a_scale = K.fp8_quantize(a, recipe, backend="reference")
    b_data, b_scale = K.fp8_quantize(
        b, recipe, b_dtype, dim=-2, block=(128, 128), backend="reference"
    )
    return (a_data, a_scale, b_data, b_scale), (a, b)


def _blocks_loop(a_data, a_scale, b_data, b_scale, recipe):
    """float64, one 128-deep K block at a time: each block's product times its scales."""
    m, k = a_data.shape
    n = b_data.shape[1]
    out = torch.zeros(m, n, dtype=torch.float64)
    for k0 in range(0, k, 128):
        t = k0 // 128
        a_part, b_part = a_data[:, k0 : k0 + 128].double(), b_data[k0 : k0 + 128].double()
        match recipe:
            case "tensorwise" | "rowwise":  # [1, 1] * [1, 1], or [m, 1] * [1, n]
                scales = a_scale.double() * b_scale.double()
            case _:
                b_cols = b_scale[t].double().repeat_interleave(128)[:n]
                scales = a_scale[:, t : t + 1].double() * b_cols[None, :]
        out += (a_part @ b_part) * scales
    return out


def _snr_db(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return 10 * torch.log10(exact.square().sum() / (actual - exact).square().sum()).item()


@pytest.mark.parametrize("recipe", RECIPES)
def test_reference_matches_a_loop_over_k_blocks_and_the_float32_matmul(recipe):
    operands, (a, b) = _operands(33, 300, 136, recipe)
    out = K.fp8_gemm(*operands, recipe, torch.float32, backend="reference")
    torch.testing.assert_close(out.double(), _blocks_loop(*operands, recipe), rtol=1e-5, atol=1e-5)
    # e4m3 has 3 mantissa bits: about 28 dB per operand on Gaussian data; issue 28 asks >= 18.
    assert _snr_db(out, a @ b) >= 25


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("recipe", RECIPES)
def test_triton_matches_reference(recipe, out_dtype, device):
    # K = 300 and N = 136: ragged 128-blocks in both; M = 33 leaves a partial row tile.
    for m, k, n in ((33, 300, 136), (1, 130, 7)):
        operands, _ = _operands(m, k, n, recipe, device)
        got = K.fp8_gemm(*operands, recipe, out_dtype, backend="triton")
        want = K.fp8_gemm(*operands, recipe, out_dtype, backend="reference")
        assert got.shape == (m, n)
        _assert_matches_reference(got, want, operands, recipe, out_dtype)


@pytest.mark.parametrize("recipe", RECIPES)
def test_triton_sums_a_long_k_in_float32(recipe, device):
    """Positive operands, K = 4096: every partial sum grows, so a sum kept in the tensor cores'
    narrow accumulator over all of K would be off by about K / 256 times the bound (DeepSeek-V3
    saw 2% at this K); promoted to float32 every 128, it stays within it."""
    torch.manual_seed(0)
    a = torch.rand(16, 4096, device=device) + 0.5
    b = torch.rand(4096, 16, device=device) + 0.5
    operands = (*K.fp8_quantize(a, recipe), *K.fp8_quantize(b, recipe, dim=-2, block=(128, 128)))
    got = K.fp8_gemm(*operands, recipe, torch.float32, backend="triton")
    want = K.fp8_gemm(*operands, recipe, torch.float32, backend="reference")
    _assert_matches_reference(got, want, operands, recipe)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torch_scaled_mm_matches_reference(recipe, device):
    operands, _ = _operands(33, 144, 48, recipe, device)
    for out_dtype in (torch.bfloat16, torch.float32):
        if device == "cuda" and recipe == "rowwise" and out_dtype != torch.bfloat16:
            continue
        got = K.fp8_gemm(*operands, recipe, out_dtype, backend="torch")
        want = K.fp8_gemm(*operands, recipe, out_dtype, backend="reference")
        _assert_matches_reference(got, want, operands, recipe, out_dtype)


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
def test_a_linear_weight_is_b_transposed_and_e5m2_mixes_with_e4m3(backend, device):
    """``x @ w.T`` for ``w [N, K]`` quantized per row, its data and scale passed as views."""
    torch.manual_seed(0)
    x, w = torch.randn(17, 64, device=device), torch.randn(32, 64, device=device)
    x_data, x_scale = K.fp8_quantize(x, "rowwise", E5M2)
    w_data, w_scale = K.fp8_quantize(w, "rowwise")
    out = K.fp8_gemm(x_data, x_scale, w_data.t(), w_scale.t(), "rowwise", backend=backend)
    exact = x @ w.T
    assert out.dtype == torch.bfloat16
    assert _snr_db(out.float(), exact) >= 18  # e5m2 has 2 mantissa bits


def test_automatic_choice_and_refusal_by_recipe():
    operands, _ = _operands(16, 32, 16, "blockwise")
    with pytest.raises(
        KernelUnavailableError,
        match=r"backend 'torch' of op 'fp8_gemm' cannot run.*implements \['rowwise', "
        r"'tensorwise'\], not 'blockwise'",
    ):
        K.fp8_gemm(*operands, "blockwise", backend="torch")
    with K.use(fp8_gemm="reference"):  # what auto picks for blockwise on CPU
        want = K.fp8_gemm(*operands, "blockwise")
    torch.testing.assert_close(K.fp8_gemm(*operands, "blockwise"), want, rtol=0, atol=0)


def test_errors():
    (a, a_scale, b, b_scale), _ = _operands(16, 40, 24, "rowwise")
    with pytest.raises(KernelInputError, match=r"a_data.shape\[1\] \(K\) to be a multiple of 16"):
        K.fp8_gemm(a, a_scale, b, b_scale, "rowwise", backend="torch")
    (a, a_scale, b, b_scale), _ = _operands(16, 32, 24, "rowwise")
    with pytest.raises(KernelInputError, match=r"b_data.shape\[1\] \(N\) to be a multiple of 16"):
        K.fp8_gemm(a, a_scale, b, b_scale, "rowwise", backend="torch")
    (a, a_scale, b, b_scale), _ = _operands(16, 32, 16, "rowwise")
    with pytest.raises(KernelInputError, match=r"two float8_e5m2 operands"):
        K.fp8_gemm(a.to(E5M2), a_scale, b.to(E5M2), b_scale, "rowwise", backend="torch")
    with pytest.raises(KernelInputError, match=r"fp8_gemm: a_data must be float8_e4m3fn or"):
        K.fp8_gemm(a.float(), a_scale, b, b_scale, "rowwise")
    with pytest.raises(KernelInputError, match=r"a_scale must be a float32 tensor"):
        K.fp8_gemm(a, a_scale.double(), b, b_scale, "rowwise")
    with pytest.raises(KernelInputError, match=r"b_scale.shape=\(16, 1\), expected \(1, 16\)"):
        K.fp8_gemm(a, a_scale, b, b_scale.t(), "rowwise")
    with pytest.raises(KernelInputError, match=r"a_data must be \[M, K\] and b_data \[K, N\]"):
        K.fp8_gemm(a, a_scale, b[:8], b_scale, "rowwise")
    with pytest.raises(KernelInputError, match=r"unknown recipe='mxfp8'"):
        K.fp8_gemm(a, a_scale, b, b_scale, "mxfp8")
    with pytest.raises(KernelInputError, match=r"out_dtype=torch.float64 is not one of"):
        K.fp8_gemm(a, a_scale, b, b_scale, "rowwise", torch.float64)


def _grouped_operands(recipe: str, sizes: list[int], k: int, n: int, device: str = "cpu"):
    torch.manual_seed(0)
    x = torch.randn(sum(sizes), k, device=device)
    w = torch.randn(len(sizes), k, n, device=device) * k**-0.5
    a_data, a_scale = K.fp8_quantize(x, recipe, backend="reference")
    b_data, b_scale = K.fp8_quantize(w, recipe, dim=-2, block=(128, 128), backend="reference")
    group_sizes = torch.tensor(sizes, device=device)
    return (a_data, a_scale, b_data, b_scale, group_sizes), (x, w)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_grouped_reference_is_one_fp8_gemm_per_expert(recipe):
    """Row scales split with their rows (tensorwise has one scale for all rows: not split)."""
    (a, a_scale, b, b_scale, sizes), _ = _grouped_operands(recipe, [9, 0, 13, 15], 130, 40)
    got = K.fp8_grouped_gemm(a, a_scale, b, b_scale, sizes, recipe, torch.float32)
    rows = torch.arange(a.shape[0]).split(sizes.tolist())
    want = torch.cat(
        [
            K.fp8_gemm(
                a[r], a_scale[r], b[e], b_scale[e], recipe, torch.float32, backend="reference"
            )
            for e, r in enumerate(rows)
        ]
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_triton_matches_reference(recipe, device):
    cases = ([9, 0, 13, 0, 15], 130, 40), ([0, 0, 0], 16, 24), ([0, 37], 17, 9)
    for sizes, k, n in cases:
        operands, (x, w) = _grouped_operands(recipe, sizes, k, n, device)
        got = K.fp8_grouped_gemm(*operands, recipe, torch.float32, backend="triton")
        want = K.fp8_grouped_gemm(*operands, recipe, torch.float32, backend="reference")
        assert got.shape == (sum(sizes), n)
        _assert_matches_reference(got, want, operands, recipe)
        exact = K.grouped_gemm(x, w, operands[-1], backend="reference")
        if exact.numel():
            assert _snr_db(got, exact) >= 25


def test_grouped_errors():
    (a, a_scale, b, b_scale, sizes), _ = _grouped_operands("blockwise", [3, 5], 32, 16)
    with pytest.raises(KernelInputError, match=r"group_sizes must be an int32 or int64 tensor"):
        K.fp8_grouped_gemm(a, a_scale, b, b_scale, sizes.float(), "blockwise")
    with pytest.raises(KernelInputError, match=r"b_scale.shape=\(1, 1\), expected \(2, 1, 1\)"):
        K.fp8_grouped_gemm(a, a_scale, b, b_scale[0], sizes, "blockwise")
    with pytest.raises(KernelInputError, match=r"a_data must be \[T, K\] and b_data \[E, K, N\]"):
        K.fp8_grouped_gemm(a, a_scale, b[0], b_scale, sizes, "blockwise")


# opcheck's schema test multiplies the inputs, which torch does not implement for fp8.
CHECKS = ("test_faketensor", "test_aot_dispatch_dynamic")


def test_custom_op_registrations(device):
    operands, _ = _grouped_operands("blockwise", [9, 0, 4], 130, 40, device)
    args = (*operands, "blockwise", torch.float32)
    torch.library.opcheck(_fp8_gemm._triton_grouped, args, test_utils=CHECKS)
    (a, a_scale, b, b_scale), _ = _operands(8, 32, 16, "rowwise", device)
    args = (a, a_scale, b, b_scale, torch.bfloat16)
    torch.library.opcheck(_fp8_gemm._scaled_mm, args, test_utils=CHECKS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's rowwise _scaled_mm limits")
def test_cuda_rowwise_scaled_mm_refusals():
    (a, a_scale, b, b_scale), _ = _operands(16, 32, 16, "rowwise", "cuda")
    with pytest.raises(KernelInputError, match=r"writes bfloat16 only, got out_dtype="):
        K.fp8_gemm(a, a_scale, b, b_scale, "rowwise", torch.float32, backend="torch")
    with pytest.raises(KernelInputError, match=r"takes a float8_e4m3fn b_data"):
        K.fp8_gemm(a, a_scale, b.to(E5M2), b_scale, "rowwise", backend="torch")
