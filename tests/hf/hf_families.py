"""Small random ``transformers`` models of every family ``d9d.hf`` knows, and their batches.

Each config keeps its family's defaults (activation, norm eps, RoPE, tied embeddings, biases,
Gemma2's soft-capping and query scale, routing options) and shrinks only sizes: vocab 97 (an
uneven shard over 2 ranks), hidden 48, 2 layers, 6 query heads of 8 dims over 2 kv heads
(3 per tensor-parallel rank, 3 per group), 5 experts. Token ids out of the small vocab move
into it: a pad id to 96, the last row of the second vocab shard. Dropout is 0: its draws
would differ between layouts.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from equivalence import batches

import d9d

VOCAB = 97

# family -> (config and model class prefix, size overrides)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {}),
    "mistral": ("Mistral", {}),
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", {}),
    "gemma": ("Gemma", {}),
    "gemma2": ("Gemma2", {}),
    "phi3": ("Phi3", {}),
    # Experts as a loop of matmuls: torch._grouped_mm, transformers' default, takes no float64.
    "qwen3_moe": (
        "Qwen3Moe",
        {"num_experts": 5, "num_experts_per_tok": 2, "experts_implementation": "eager"},
    ),
    "mixtral": (
        "Mixtral",
        {"num_local_experts": 5, "num_experts_per_tok": 2, "experts_implementation": "eager"},
    ),
    "gpt2": ("GPT2", {}),
}

_SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "intermediate_size": 40,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
}
_GPT2_SIZES = {
    "vocab_size": VOCAB,
    "n_embd": 48,
    "n_layer": 2,
    "n_head": 6,
    "n_positions": 64,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
_TOKEN_IDS = {"pad_token_id": VOCAB - 1, "bos_token_id": 1, "eos_token_id": 2}


def config(family: str, **overrides: Any) -> Any:
    """The family's default config with small sizes (see the module docstring) and
    ``overrides``."""
    import transformers

    name, extra = FAMILIES[family]
    config_class = getattr(transformers, f"{name}Config")
    defaults = config_class()
    sizes = _GPT2_SIZES if family == "gpt2" else _SIZES
    fields = {k: v for k, v in sizes.items() if hasattr(defaults, k)}
    for key, moved in _TOKEN_IDS.items():
        value = getattr(defaults, key, None)
        if isinstance(value, int) and value >= VOCAB:
            fields[key] = moved
    return config_class(**{**fields, **extra, **overrides})


@functools.cache
def _module(family: str, overrides: tuple[tuple[str, Any], ...]) -> torch.nn.Module:
    import transformers

    name = FAMILIES[family][0]
    model_class = getattr(
        transformers, f"{name}LMHeadModel" if family == "gpt2" else f"{name}ForCausalLM"
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return model_class(config(family, **dict(overrides))).to(torch.float64)


def build(family: str, **overrides: Any) -> Callable[[], d9d.Model]:
    """A builder of the family's float64 model (config ``overrides`` on top), functionalized
    with no ``axes``: the rules are d9d.hf's. Built once and copied per rank (threads share
    the global RNG)."""
    module = _module(family, tuple(sorted(overrides.items())))
    return lambda: d9d.functionalize(copy.deepcopy(module))


def data(steps: int = 3) -> list[dict]:
    """``steps`` global batches of 4 sequences of 8 tokens, half of whose labels are ignored,
    unevenly: a whole row, 10 of the 16 ignored tokens in rows 0-1 (the first data-parallel
    rank, the first of 2 microbatches) and 10 to 12 in the first rank's zigzag chunks under cp=2.

    The global count of valid tokens is a power of two (16), so that every layout's loss
    scaling (1/16 on one device, 2/16 per data-parallel rank, a microbatch's grads summed and
    then divided by 16) commutes with the float32 rounding Hugging Face norms do in their
    backward; with 15 valid tokens pipeline grads differ from one device's by ~1e-7 relative.
    """
    out = batches(VOCAB, global_batch=4, seq_len=8, steps=steps)
    for i, batch in enumerate(out):
        labels = batch["labels"].clone()  # a view of the tokens
        labels[0, :] = -100
        labels[1, :2] = -100
        labels[2, [0, 1, 6, 7]] = -100
        labels[3, 4 + i : 6 + i] = -100
        batch["labels"] = labels
    return out
