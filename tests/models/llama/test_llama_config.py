"""LlamaConfig: presets, validation messages, parameter and FLOP counts."""

from __future__ import annotations

import dataclasses
import doctest

import pytest

from d9d.errors import ConfigError
from d9d.models import LlamaConfig
from d9d.models.llama import _config


def test_docstring_examples_run() -> None:
    assert doctest.testmod(_config, raise_on_error=True).attempted > 0


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("tiny", dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176)),
        ("small", dict(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688)),
        ("1b", dict(vocab_size=128_256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8)),
        ("8b", dict(vocab_size=128_256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8)),
    ],
)
def test_presets(name: str, expected: dict[str, int]) -> None:
    cfg = LlamaConfig.preset(name)
    assert {k: getattr(cfg, k) for k in expected} == expected


def test_preset_classmethods_and_overrides() -> None:
    assert LlamaConfig.preset("1b") == LlamaConfig.llama_1b()
    assert LlamaConfig.preset("8b") == LlamaConfig.llama_8b()
    assert LlamaConfig.llama_1b().tie_embeddings and not LlamaConfig.llama_8b().tie_embeddings
    assert LlamaConfig.llama_8b().rope_theta == 500_000.0
    assert LlamaConfig.llama_8b().ffn_dim == 14_336
    assert LlamaConfig.tiny(seed=3).seed == 3
    assert LlamaConfig.preset("small", n_layers=2).n_layers == 2


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(ConfigError, match=r"name='70b'.*'tiny', 'small', '1b', '8b'"):
        LlamaConfig.preset("70b")


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        LlamaConfig.tiny().dim = 32  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(dim=0), r"dim must be a positive int, got dim=0"),
        (dict(vocab_size=-1), r"vocab_size must be a positive int, got vocab_size=-1"),
        (dict(n_layers=2.0), r"n_layers must be a positive int, got n_layers=2.0"),
        (dict(n_kv_heads=True), r"n_kv_heads must be a positive int, got n_kv_heads=True"),
        (dict(norm_eps=0.0), r"norm_eps must be a finite positive number, got norm_eps=0.0"),
        (dict(rope_theta=-1.0), r"rope_theta must be a finite positive number, got rope_theta=-1"),
        (dict(init_std=0), r"init_std must be a finite positive number, got init_std=0"),
        # an infinite eps zeroed every activation, an infinite std gave NaN weights, unrefused
        (
            dict(norm_eps=float("inf")),
            r"norm_eps must be a finite positive number, got norm_eps=inf",
        ),
        (
            dict(init_std=float("inf")),
            r"init_std must be a finite positive number, got init_std=inf",
        ),
        (dict(dim=66), r"dim must be divisible by n_heads, got dim=66, n_heads=4: pick"),
        (dict(n_kv_heads=3), r"n_heads=4, n_kv_heads=3: pick n_kv_heads among the divisors"),
        (dict(dim=12, n_heads=4), r"must be even for RoPE.*head_dim=3"),
        (dict(seed="0"), r"seed must be an int, got seed='0'"),
    ],
)
def test_validation(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LlamaConfig.tiny(**overrides)


def test_param_counts_of_real_models() -> None:
    assert LlamaConfig.llama_8b().num_params == 8_030_261_248  # Llama 3 8B model card: 8.03B
    assert LlamaConfig.llama_1b().num_params == 1_235_814_400  # Llama 3.2 1B: 1.24B
    assert LlamaConfig.llama_1b(tie_embeddings=False).num_params == 1_235_814_400 + 128_256 * 2048


def test_flops_per_token() -> None:
    cfg = LlamaConfig.llama_8b()
    # every matmul weight (head included, embedding lookup excluded) + PaLM's attention term
    matmul = cfg.num_params - cfg.vocab_size * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim
    assert cfg.flops_per_token(2048) == 6 * matmul + 12 * 32 * 4096 * 2048
    assert cfg.flops_per_token() == cfg.flops_per_token(8192)
    tied = LlamaConfig.llama_1b()  # a tied head still costs its matmul
    assert tied.flops_per_token(1) == 6 * tied.num_params - 6 * 33 * 2048 + 12 * 16 * 2048


def test_flops_per_token_rejects_bad_seq_len() -> None:
    with pytest.raises(ConfigError, match=r"positive int seq_len, got seq_len=0"):
        LlamaConfig.tiny().flops_per_token(0)
