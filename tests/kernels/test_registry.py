"""The registry: selection order, overrides, availability and its errors."""

from __future__ import annotations

import threading

import pytest
import torch

import d9d.kernels as K
from d9d.errors import KernelUnavailableError, UnknownKernelError
from d9d.kernels import _registry, _triton_env


@pytest.fixture
def marked_backends():
    """Backends "a" and "b" of swiglu returning 1 and 2; removed afterwards."""
    saved = dict(_registry._OPS["swiglu"].backends)
    for value, name in enumerate("ab", start=1):
        K.register_backend(
            "swiglu",
            name,
            lambda gate, up, value=value: torch.full_like(gate, value),
            dtypes={torch.float32},
            auto=lambda device_type: False,
        )
    yield
    _registry._OPS["swiglu"].backends = saved
    _registry._parse_env.cache_clear()


def _which(**kwargs) -> float:
    return K.swiglu(torch.zeros(1), torch.zeros(1), **kwargs).item()


def test_selection_order(marked_backends, monkeypatch):
    assert _which() == 0.0  # automatic: "a" and "b" opt out of it, the reference runs
    monkeypatch.setenv("D9D_KERNELS", "rms_norm=reference, swiglu=a")
    assert _which() == 1.0
    with K.use(swiglu="b"):
        assert _which() == 2.0
        assert _which(backend="a") == 1.0
        with K.use(swiglu="auto"):
            assert _which() == 0.0
        assert _which() == 2.0
    assert _which(backend="auto") == 0.0


def test_use_is_scoped_to_its_thread(marked_backends):
    seen = []
    with K.use(swiglu="a"):
        thread = threading.Thread(target=lambda: seen.append(_which()))
        thread.start()
        thread.join()
        assert _which() == 1.0
    assert seen == [0.0]


def test_automatic_selection_on_cpu_never_picks_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(2, 8)
    impl = _registry.resolve("rms_norm", x, None)
    assert impl is _registry._OPS["rms_norm"].backends["reference"].impl
    flce = _registry.resolve("fused_linear_cross_entropy", x, None)
    assert flce is _registry._OPS["fused_linear_cross_entropy"].backends["chunked"].impl


def test_automatic_selection_falls_back_by_dtype():
    x = torch.randn(2, 8, dtype=torch.float64)
    impl = _registry.resolve("fused_linear_cross_entropy", x, None)
    assert impl is _registry._OPS["fused_linear_cross_entropy"].backends["chunked"].impl


def test_modes_that_differ_by_device_are_refused_by_name_and_skipped_by_auto(monkeypatch):
    """torch 2.11's CPU ``_scaled_mm`` has tensorwise scales only: its rowwise calls go to the
    next backend automatically, and a forced one names the modes this device has."""
    from d9d.kernels import _fp8_gemm

    monkeypatch.setattr(_fp8_gemm, "_cpu_scaled_mm_is_rowwise", lambda: False)
    data = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    scaled_mm = _registry._OPS["fp8_gemm"].backends["torch"].impl
    assert _registry.resolve("fp8_gemm", data, None, "tensorwise") is scaled_mm
    assert _registry.resolve("fp8_gemm", data, None, "rowwise") is not scaled_mm
    with pytest.raises(KernelUnavailableError, match=r"implements \['tensorwise'\], not 'rowwise'"):
        _registry.resolve("fp8_gemm", data, "torch", "rowwise")
    monkeypatch.setattr(_fp8_gemm, "_cpu_scaled_mm_is_rowwise", lambda: True)
    assert _registry.resolve("fp8_gemm", data, None, "rowwise") is scaled_mm


def test_available_lists_ops_backends_and_reasons(monkeypatch):
    table = K.available()
    assert sorted(table) == [
        "adamw",
        "block_attention",
        "combine",
        "cross_entropy",
        "dispatch",
        "fp8_gemm",
        "fp8_grouped_gemm",
        "fp8_grouped_gemm_k",
        "fp8_quantize",
        "fused_add_rms_norm",
        "fused_linear_cross_entropy",
        "grouped_gemm",
        "moe_permute",
        "moe_unpermute",
        "rms_norm",
        "rope",
        "swiglu",
    ]
    assert list(table["fused_linear_cross_entropy"]) == ["triton", "chunked", "reference"]
    assert list(table["grouped_gemm"]) == ["torch", "triton", "reference"]
    assert list(table["fp8_gemm"]) == ["torch", "triton", "reference"]
    assert list(table["dispatch"]) == list(table["combine"]) == ["c10d", "reference"]
    assert all(backends["reference"] is None for backends in table.values())
    monkeypatch.setattr(_triton_env, "_installed", lambda: False)
    assert (
        K.available()["rms_norm"]["triton"] == "triton is not installed (pip install 'd9d[triton]')"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_triton_unavailable_without_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert K.available()["swiglu"]["triton"] == "no CUDA device and TRITON_INTERPRET is not set"
    x = torch.ones(2)
    with pytest.raises(
        KernelUnavailableError,
        match=r"backend='triton': backend 'triton' of op 'swiglu' cannot run on cpu tensors .*"
        r"TRITON_INTERPRET is not set.*one of \['reference'\]",
    ):
        K.swiglu(x, x, backend="triton")
    monkeypatch.setenv("D9D_KERNELS", "swiglu=triton")
    with pytest.raises(KernelUnavailableError, match=r"D9D_KERNELS='swiglu=triton': backend"):
        K.swiglu(x, x)


def test_forced_backend_with_an_unsupported_dtype():
    x = torch.ones(2, dtype=torch.float64)
    with (
        pytest.raises(
            KernelUnavailableError,
            match=r"use\(swiglu='triton'\).*supports dtypes bfloat16, float16, float32, got torch.f",
        ),
        K.use(swiglu="triton"),
    ):
        K.swiglu(x, x)
    with pytest.raises(KernelUnavailableError, match=r"Triton runs on cuda tensors .* not meta"):
        K.swiglu(x.float().to("meta"), x.float().to("meta"), backend="triton")


def test_unknown_names():
    x = torch.ones(2)
    with pytest.raises(UnknownKernelError, match=r"op 'swiglu' has no backend 'cuda'; backends"):
        K.swiglu(x, x, backend="cuda")
    with pytest.raises(UnknownKernelError, match=r"use\(swigl='triton'\) names unknown op 'swigl'"):
        K.use(swigl="triton").__enter__()
    with pytest.raises(UnknownKernelError, match=r"names unknown backend 'fast' for op 'swiglu'"):
        K.use(swiglu="fast").__enter__()
    with pytest.raises(UnknownKernelError, match=r"cannot register a backend for op='swigl'"):
        K.register_backend("swigl", "mine", lambda g, u: g, dtypes={torch.float32})
    with pytest.raises(UnknownKernelError, match=r"backend name='auto' is reserved"):
        K.register_backend("swiglu", "auto", lambda g, u: g, dtypes={torch.float32})


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("swiglu", r"entry 'swiglu' is not 'op=backend'"),
        ("swiglu=", r"entry 'swiglu=' is not 'op=backend'"),
        ("swigl=triton", r"D9D_KERNELS='swigl=triton' names unknown op 'swigl'"),
        ("swiglu=fast", r"names unknown backend 'fast' for op 'swiglu'"),
    ],
)
def test_bad_environment_variable(value, match, monkeypatch):
    monkeypatch.setenv("D9D_KERNELS", value)
    with pytest.raises(UnknownKernelError, match=match):
        K.swiglu(torch.ones(1), torch.ones(1))
