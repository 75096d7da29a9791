"""Model FLOPs utilization (MFU) of ``d9d train``: the FLOPs a step does, against the peak of
the device it runs on."""

from __future__ import annotations

from ..models import LlamaConfig, MoEConfig

__all__ = [
    "PEAK_BF16_FLOPS",
    "PEAK_FP8_FLOPS",
    "mfu",
    "peak_bf16_flops",
    "peak_fp8_flops",
    "train_flops_per_token",
]

PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
)
"""Dense (no sparsity) bf16 tensor-core peak FLOP/s per device, from NVIDIA's datasheets, as
``(substring of torch.cuda.get_device_name(), flops)``; the first match wins. H100 is the SXM
part; other devices have no MFU."""

PEAK_FP8_FLOPS = (
    ("H200", 1979e12),
    ("H100 PCIe", 1513e12),
    ("H100", 1979e12),
)
"""Dense fp8 (e4m3/e5m2) tensor-core peak FLOP/s, twice the bf16 peak, as
:data:`PEAK_BF16_FLOPS`; the A100 has no fp8 tensor cores."""


def train_flops_per_token(config: LlamaConfig | MoEConfig, seq_len: int) -> int:
    """Training FLOPs (forward and backward) per token of a Llama or MoE model.

    ``6 * N`` with ``N`` the weights one token goes through in matmuls (attention, MLPs, the
    router, ``top_k`` routed experts and the shared ones, the output head; not the embedding
    lookup or the norms), plus ``12 * n_layers * n_heads * head_dim * seq_len`` for the
    attention scores and values over the whole (unmasked) score matrix, as PaLM counts them
    (arXiv:2204.02311, appendix B).

    Args:
        config: The model's config.
        seq_len: Tokens per sequence.

    Returns:
        FLOPs per trained token.

    Example:
        >>> train_flops_per_token(LlamaConfig.tiny(), 16)
        675840
    """
    if isinstance(config, LlamaConfig):
        return config.flops_per_token(seq_len)
    heads = config.attention_head_dim
    attention = 2 * config.dim * heads * (config.n_heads + config.n_kv_heads)
    dense = config.n_dense_layers * (attention + 3 * config.dim * config.ffn_dim)
    sparse = config.n_moe_layers * (attention + config.moe.active_params)
    matmul_params = dense + sparse + config.vocab_size * config.dim
    return 6 * matmul_params + 12 * config.n_layers * config.n_heads * heads * seq_len


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of a device named like ``"NVIDIA H100 80GB HBM3"``, or
    None for a device not in :data:`PEAK_BF16_FLOPS`."""
    return _peak(PEAK_BF16_FLOPS, device_name)


def peak_fp8_flops(device_name: str) -> float | None:
    """The dense fp8 peak FLOP/s of a device, or None for one not in :data:`PEAK_FP8_FLOPS`.

    Example:
        >>> peak_fp8_flops("NVIDIA H200")
        1979000000000000.0
    """
    return _peak(PEAK_FP8_FLOPS, device_name)


def _peak(table: tuple[tuple[str, float], ...], device_name: str) -> float | None:
    return next((flops for part, flops in table if part in device_name), None)


def mfu(flops_per_token: int, tokens_per_s: float, peak_flops: float, devices: int) -> float:
    """The fraction of ``devices`` devices' peak that training at ``tokens_per_s`` uses."""
    return flops_per_token * tokens_per_s / (peak_flops * devices)
