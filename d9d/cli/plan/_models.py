"""The model ``d9d plan`` lays out, built on the meta device: a d9d preset or a Hugging Face
config file."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import torch

from ...core._model import Model, functionalize
from ...models import Llama, LlamaConfig, MoE, MoEConfig

__all__ = ["HF_AXES", "build_model"]

HF_AXES = {
    r"q_proj\.weight$": ("heads", "embed"),
    r"[kv]_proj\.weight$": ("kv_heads", "embed"),
    r"o_proj\.weight$": ("embed", "heads"),
    r"(gate|up)_proj\.weight$": ("mlp", "embed"),
    r"down_proj\.weight$": ("embed", "mlp"),
    r"lm_head\.weight$": ("vocab", "embed"),
    r"embed_tokens\.weight$": ("vocab", "embed"),
    r"norm\.weight$": ("embed",),
    r"q_proj\.bias$": ("heads",),
    r"[kv]_proj\.bias$": ("kv_heads",),
}
"""Logical axes of the Llama-like Hugging Face families (Llama, Mistral, Qwen2, Gemma), used
until ``d9d.hf`` chooses them from the model's class."""


def build_model(
    model: str, preset: str, hf_config: Path | None, *, n_layers: int | None = None
) -> tuple[Model, LlamaConfig | MoEConfig | None, str]:
    """``(functionalized model on meta, its d9d config or None, a one-line description)``;
    ``n_layers`` overrides the number of blocks of a preset or a Hugging Face config (whose
    ``layer_types`` it cuts to the first ``n_layers``).

    Raises:
        ConfigError: ``preset`` is not a preset of ``model``.
        FileNotFoundError: ``hf_config`` does not exist.
        ValueError: ``hf_config`` is not a transformers config.
    """
    if hf_config is not None:
        return _hf(hf_config, n_layers)
    overrides = {} if n_layers is None else {"n_layers": n_layers}
    config = (MoEConfig if model == "moe" else LlamaConfig).preset(preset, **overrides)
    with torch.device("meta"):
        module = MoE(config) if model == "moe" else Llama(config)
    count = sum(p.numel() for p in module.parameters())
    return functionalize(module), config, f"{model} {preset} ({_count(count)} params)"


def _hf(path: Path, n_layers: int | None) -> tuple[Model, None, str]:
    if not path.is_file():
        raise FileNotFoundError(f"--hf-config {str(path)!r} is not a file; pass a config.json")
    try:
        fields: dict[str, Any] = json.loads(path.read_text())
        model_type = fields.pop("model_type")
    except (json.JSONDecodeError, KeyError, AttributeError) as error:
        raise ValueError(
            f"--hf-config {str(path)!r} is not a transformers config.json with a model_type "
            f"({error})"
        ) from None
    if n_layers is not None:
        fields["num_hidden_layers"] = n_layers
        if isinstance(fields.get("layer_types"), list):
            fields["layer_types"] = fields["layer_types"][:n_layers]
    import transformers

    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except ValueError as error:
        raise ValueError(f"--hf-config {str(path)!r}: {error}") from None
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in module.parameters())
    name = type(module).__name__
    if importlib.util.find_spec("d9d.hf") is not None:  # d9d picks the family's rules
        return functionalize(module), None, f"{name} ({_count(count)} params)"
    paths = [path for path, _ in module.named_parameters()]
    axes = {p: a for p, a in HF_AXES.items() if any(re.search(p, q) for q in paths)}
    return functionalize(module, axes=axes), None, f"{name} ({_count(count)} params)"


def _count(n: int) -> str:
    for size, unit in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)
