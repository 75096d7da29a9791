from __future__ import annotations

import doctest

import pytest
import torch

from d9d.cli import _flops
from d9d.cli._flops import mfu, peak_bf16_flops, peak_fp8_flops, train_flops_per_token
from d9d.cli.train._metrics import SpeedMeter
from d9d.models import LlamaConfig, MoEConfig


def test_llama_tiny_flops_by_hand() -> None:
    # tiny: dim 64, 2 layers, 4 heads of 16, 2 kv heads, ffn 176, vocab 256, untied head.
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64  # wq, wk, wv, wo
    mlp = 3 * 64 * 176  # gate, up, down
    matmul_params = 2 * (attention + mlp) + 256 * 64  # blocks and head, no embedding
    scores = 12 * 2 * 4 * 16 * 16  # 12 * layers * heads * head_dim * seq_len
    assert train_flops_per_token(LlamaConfig.tiny(), 16) == 6 * matmul_params + scores == 675840


def test_moe_tiny_flops_count_the_active_experts_only() -> None:
    # Block 0 dense (ffn 176); block 1: router over 6 experts, top-2 of width 40, 1 shared.
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64
    moe = 6 * 64 + 2 * 3 * 64 * 40 + 3 * 64 * 40
    matmul_params = 2 * attention + 3 * 64 * 176 + moe + 256 * 64
    scores = 12 * 2 * 4 * 16 * 16
    assert train_flops_per_token(MoEConfig.tiny(), 16) == 6 * matmul_params + scores == 613632


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Tesla T4", None),
    ],
)
def test_peak_flops_per_device(name: str, peak: float | None) -> None:
    assert peak_bf16_flops(name) == peak


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 1979e12),
        ("NVIDIA H100 PCIe", 1513e12),
        ("NVIDIA H200", 1979e12),
        ("NVIDIA A100-SXM4-80GB", None),
    ],
)
def test_fp8_peak_flops_per_device(name: str, peak: float | None) -> None:
    assert peak_fp8_flops(name) == peak


def test_mfu_is_achieved_over_peak_flops() -> None:
    # 1e6 FLOPs/token at 1e8 tokens/s on 2 devices of 1e15 FLOP/s: 5%.
    assert mfu(1_000_000, 1e8, 1e15, 2) == pytest.approx(0.05)


def test_cpu_speed_has_no_mfu() -> None:
    speed = SpeedMeter(
        tokens_per_step=64, flops_per_token=10, device=torch.device("cpu"), devices=1
    )
    assert speed.measure(steps=4, seconds=2.0) == {"tokens_per_s": 128.0, "step_time_s": 0.5}


def test_gpu_speed_has_mfu_on_a_known_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    speed = SpeedMeter(
        tokens_per_step=1000, flops_per_token=989, device=torch.device("cuda"), devices=1
    )
    assert speed.measure(steps=1, seconds=1e-9)["mfu"] == pytest.approx(1.0)


def test_gpu_of_unknown_peak_has_no_mfu_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla T4")
    speed = SpeedMeter(
        tokens_per_step=1000, flops_per_token=10, device=torch.device("cuda"), devices=1
    )
    assert "mfu" not in speed.measure(steps=1, seconds=1.0)
    assert (
        "no MFU in the metrics: the peak FLOP/s of 'Tesla T4' is not known"
        in capsys.readouterr().err
    )


def test_fp8_run_states_mfu_against_the_fp8_peak_and_the_bf16_one_beside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    speed = SpeedMeter(
        tokens_per_step=1000, flops_per_token=1979, device=torch.device("cuda"), devices=1, fp8=True
    )
    figures = speed.measure(steps=1, seconds=1e-9)
    assert figures["mfu"] == pytest.approx(1.0)
    assert figures["mfu_bf16"] == pytest.approx(1979 / 989)


def test_fp8_run_on_a_gpu_without_an_fp8_peak_states_the_bf16_mfu_and_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    speed = SpeedMeter(
        tokens_per_step=1000, flops_per_token=312, device=torch.device("cuda"), devices=1, fp8=True
    )
    assert speed.measure(steps=1, seconds=1e-9).keys() == {
        "tokens_per_s",
        "step_time_s",
        "mfu_bf16",
    }
    assert (
        "no fp8 MFU in the metrics: the fp8 peak FLOP/s of 'NVIDIA A100" in capsys.readouterr().err
    )


def test_docstring_examples_run() -> None:
    assert doctest.testmod(_flops, raise_on_error=True).attempted == 2
