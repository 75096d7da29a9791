"""Hugging Face interop for the d9d Llama: ``transformers``-loadable safetensors folders.

The two models compute the same function with the same weight layouts (RoPE on rotated
halves, as in ``transformers``), so converting is renaming keys, by :data:`LLAMA_KEYS`;
``tests/models/llama/test_llama_hf_parity.py`` proves equal logits with this table.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..errors import ConfigError, ParamTreeMismatchError
from ..models import LlamaConfig
from ._hf_fields import FieldRules, check_fields
from ._safetensors_read import (
    RECOMPUTED,
    Stored,
    load_whole,
    read_placed,
    refuse_unconverted,
    safetensors_files,
)

__all__ = [
    "LLAMA_KEYS",
    "export_hf",
    "import_hf",
    "llama_config",
    "llama_from_hf",
    "llama_sources",
    "llama_to_hf",
]

LLAMA_KEYS: tuple[tuple[str, str], ...] = (
    ("embed.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attn.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attn.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attn.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attn.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.mlp.w_gate.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.w_up.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.mlp.w_down.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("head.weight", "lm_head.weight"),
)
"""``(d9d param path, Hugging Face key)`` of every Llama weight; ``{i}`` is a layer index."""

# LlamaConfig field -> config.json key (rope_theta is handled apart: transformers 5 nests it).
_CONFIG_KEYS = (
    ("vocab_size", "vocab_size"),
    ("dim", "hidden_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("n_kv_heads", "num_key_value_heads"),
    ("ffn_dim", "intermediate_size"),
    ("max_seq_len", "max_position_embeddings"),
    ("norm_eps", "rms_norm_eps"),
    ("tie_embeddings", "tie_word_embeddings"),
    ("init_std", "initializer_range"),
    ("pad_token_id", "pad_token_id"),
)
LLAMA_FIELDS = FieldRules(
    model="the d9d Llama",
    model_type="llama",
    read={
        **{theirs: f"LlamaConfig.{ours}" for ours, theirs in _CONFIG_KEYS},
        "head_dim": "must equal hidden_size / num_attention_heads (checked)",
        "rope_parameters": "rope_theta; a rope_type other than 'default' is refused",
        "rope_theta": "rope_parameters' older spelling",
        "rope_scaling": "rope_parameters' older spelling; any scaling is refused",
    },
    required={"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
)
"""What the d9d Llama does with each field of ``transformers.LlamaConfig``; every other field
must keep its default (:func:`~d9d.checkpoint._hf_fields.check_fields`)."""


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


_TO_HF = [(_pattern(ours), theirs) for ours, theirs in LLAMA_KEYS]
_FROM_HF = [(_pattern(theirs), ours) for ours, theirs in LLAMA_KEYS]


def _rename(state: Mapping[str, Any], rules: list[tuple[re.Pattern[str], str]]) -> dict[str, Any]:
    out, unknown = {}, []
    for key, value in state.items():
        match = next(((m, t) for p, t in rules if (m := p.match(key))), None)
        if match is None:
            if not RECOMPUTED.search(key):
                unknown.append(key)
            continue
        m, template = match
        out[template.replace("{i}", m.group(1)) if m.groups() else template] = value
    if unknown:
        raise ParamTreeMismatchError(
            f"Keys with no counterpart in d9d.checkpoint.LLAMA_KEYS: {sorted(unknown)[:10]}; "
            "the weights are not a Llama of the layout d9d implements."
        )
    return out


def _expected(config: LlamaConfig, hf: bool) -> set[str]:
    keys = set()
    for ours, theirs in LLAMA_KEYS:
        name = theirs if hf else ours
        layers = range(config.n_layers) if "{i}" in name else [None]
        keys |= {name.replace("{i}", str(i)) for i in layers}
    tied = "lm_head.weight" if hf else "head.weight"
    return keys - {tied} if config.tie_embeddings else keys


def _check_keys(got: set[str], config: LlamaConfig, hf: bool, what: str) -> None:
    expected = _expected(config, hf)
    if got != expected:
        raise ParamTreeMismatchError(
            f"{what} do not fit {config}: missing {sorted(expected - got)[:10]}, unexpected "
            f"{sorted(got - expected)[:10]}."
        )


def llama_to_hf(params: Mapping[str, torch.Tensor], config: LlamaConfig) -> dict[str, Any]:
    """The ``LlamaForCausalLM`` state dict of d9d Llama ``params`` (same tensors, renamed).

    Raises:
        ParamTreeMismatchError: ``params`` is not the param dict of a Llama of ``config``.

    Example:
        >>> from d9d import functionalize
        >>> from d9d.models import Llama
        >>> cfg = LlamaConfig.tiny()
        >>> state = llama_to_hf(functionalize(Llama(cfg)).params, cfg)
        >>> state["model.layers.0.self_attn.q_proj.weight"].shape
        torch.Size([64, 64])
    """
    _check_keys(set(params), config, hf=False, what="params")
    return _rename(params, _TO_HF)


def llama_from_hf(state: Mapping[str, torch.Tensor], config: LlamaConfig) -> dict[str, Any]:
    """The d9d Llama params of a ``LlamaForCausalLM`` state dict (same tensors, renamed).

    With ``config.tie_embeddings``, ``lm_head.weight`` may be present (``state_dict()`` of
    a tied model lists it) if it equals the embedding; it is dropped.

    Raises:
        ParamTreeMismatchError: A key is unknown or missing, or a tied head differs from
            the embedding.

    Example:
        >>> from d9d import functionalize
        >>> from d9d.models import Llama
        >>> cfg = LlamaConfig.tiny(tie_embeddings=True)
        >>> params = functionalize(Llama(cfg)).params
        >>> llama_from_hf(llama_to_hf(params, cfg), cfg).keys() == params.keys()
        True
    """
    params = _rename(without_tied_head(state, config.tie_embeddings), _FROM_HF)
    _check_keys(set(params), config, hf=False, what="Hugging Face weights")
    return params


def without_tied_head(state: Mapping[str, Any], tied: bool) -> dict[str, Any]:
    """``state`` without ``lm_head.weight`` when the head is ``tied`` to the embedding.

    Raises:
        ParamTreeMismatchError: The stored head differs from ``model.embed_tokens.weight``.
    """
    state = dict(state)
    if tied and "lm_head.weight" in state:
        head = state.pop("lm_head.weight")
        embed = state.get("model.embed_tokens.weight")
        if embed is None or not torch.equal(head, embed):
            raise ParamTreeMismatchError(
                "config.tie_embeddings is set but lm_head.weight differs from "
                "model.embed_tokens.weight; load it with tie_embeddings=False."
            )
    return state


def _hf_config(config: LlamaConfig, dtype: torch.dtype) -> dict[str, Any]:
    fields = {theirs: getattr(config, ours) for ours, theirs in _CONFIG_KEYS}
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **fields,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_theta": config.rope_theta,  # transformers < 5
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    check_fields(hf, LLAMA_FIELDS)  # a field transformers adds with another default: refused
    return hf


def export_hf(
    params: Mapping[str, torch.Tensor], config: LlamaConfig, path: str | os.PathLike[str]
) -> Path:
    """Write a d9d Llama as a ``transformers`` folder: ``config.json`` and ``model.safetensors``.

    ``transformers.LlamaForCausalLM.from_pretrained(path)`` then computes the same logits.
    DTensor params are gathered (``full_tensor``, so every rank must call this) and rank 0
    writes.

    Args:
        params: The d9d Llama params ``{path: tensor}`` (tensors or DTensors).
        config: The model's config.
        path: Output folder, created if missing.

    Returns:
        ``path``.

    Raises:
        ParamTreeMismatchError: ``params`` is not the param dict of a Llama of ``config``.
        ConfigError: The installed ``transformers.LlamaConfig`` has a field whose default
            the d9d Llama does not implement and the export does not set.

    Example:
        >>> import tempfile
        >>> from d9d import functionalize
        >>> from d9d.models import Llama
        >>> cfg = LlamaConfig.tiny()
        >>> folder = export_hf(functionalize(Llama(cfg)).params, cfg, tempfile.mkdtemp())
        >>> sorted(p.name for p in folder.iterdir())
        ['config.json', 'model.safetensors']
    """
    from safetensors.torch import save_file

    path = Path(path)
    state = llama_to_hf(params, config)
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().contiguous()
        for k, v in state.items()
    }
    if dist.is_initialized() and dist.get_rank() != 0:
        return path
    path.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(full.values())).dtype
    (path / "config.json").write_text(json.dumps(_hf_config(config, dtype), indent=2) + "\n")
    save_file(full, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _rope_theta(hf: dict[str, Any]) -> float:
    rope = hf.get("rope_parameters") or {}
    kind = rope.get("rope_type", "default")
    if kind != "default" or hf.get("rope_scaling"):
        raise ConfigError(
            f"The checkpoint uses RoPE scaling ({rope or hf.get('rope_scaling')}), which the "
            "d9d Llama does not implement; only rope_type 'default' loads."
        )
    return float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))


def llama_config(hf: dict[str, Any]) -> LlamaConfig:
    """The :class:`~d9d.models.LlamaConfig` of a ``transformers`` ``config.json`` dict.

    Raises:
        ConfigError: Another ``model_type``, or a field the d9d Llama does not implement
            (:data:`LLAMA_FIELDS`), named with its value.
    """
    if hf.get("model_type", "llama") != "llama":
        raise ConfigError(
            f"config.json has model_type={hf['model_type']!r}; the d9d Llama reads 'llama'."
        )
    hf = check_fields(hf, LLAMA_FIELDS)
    fields = {ours: hf[theirs] for ours, theirs in _CONFIG_KEYS if theirs in hf}
    config = LlamaConfig(**fields, rope_theta=_rope_theta(hf))
    if hf.get("head_dim", config.head_dim) != config.head_dim:
        raise ConfigError(
            f"config.json has head_dim={hf['head_dim']}, but hidden_size / "
            f"num_attention_heads = {config.head_dim}; the d9d Llama needs them equal."
        )
    return config


def llama_sources(config: LlamaConfig) -> dict[str, Stored]:
    """``{d9d param path: Stored}``: where each Llama param lies in a ``transformers`` folder."""
    pairs = []
    for ours, theirs in LLAMA_KEYS:
        layers = range(config.n_layers) if "{i}" in ours else [None]
        pairs += [(ours.replace("{i}", str(i)), theirs.replace("{i}", str(i))) for i in layers]
    return {ours: Stored((theirs,)) for ours, theirs in pairs}


def import_hf(
    path: str | os.PathLike[str], target: Any = None
) -> tuple[LlamaConfig, dict[str, Any]]:
    """Read a ``transformers`` Llama folder (``config.json`` + safetensors) as d9d params.

    Reads ``model.safetensors``, or every file that ``model.safetensors.index.json`` lists.
    With ``target`` (the placed params of a step, e.g. ``step.place`` of a Llama built on
    the ``meta`` device), each rank reads only the slices of its own shards, so no rank ever
    holds the whole model; the values equal the full import's. A tied ``lm_head.weight``
    is then not read (nor compared with the embedding).

    Args:
        path: A folder written by ``save_pretrained`` (or :func:`export_hf`).
        target: ``{d9d path: DTensor, tensor or Abstract}`` giving each param's layout and
            dtype (stored values are cast to it); ``None`` reads every param whole.

    Returns:
        ``(config, params)``: the :class:`~d9d.models.LlamaConfig` and the
        ``{path: tensor}`` params of a d9d ``Llama``, in the stored dtype; with ``target``,
        ``target``'s structure holding DTensors of this rank's shards.

    Raises:
        FileNotFoundError: ``config.json`` or the weights are missing.
        ConfigError: A config field the d9d Llama does not implement (RoPE scaling,
            ``attention_bias=True``, a field ``transformers.LlamaConfig`` does not define...),
            named with its value.
        ParamTreeMismatchError: The weights do not match the config.
        ParamShapeError: With ``target``, a stored tensor's shape does not fit its param.

    Example:
        >>> import tempfile
        >>> from d9d import functionalize
        >>> from d9d.models import Llama
        >>> folder = export_hf(functionalize(Llama(LlamaConfig.tiny())).params,
        ...                    LlamaConfig.tiny(), tempfile.mkdtemp())
        >>> config, params = import_hf(folder)
        >>> config == LlamaConfig.tiny(), len(params)
        (True, 21)
    """
    path = Path(path)
    config = llama_config(json.loads((path / "config.json").read_text()))
    if target is not None:
        sources = llama_sources(config)
        refuse_unconverted(safetensors_files(path), sources, "the d9d Llama")
        return config, read_placed(path, target, sources)
    state = load_whole(path)
    return config, llama_from_hf(state, config)
