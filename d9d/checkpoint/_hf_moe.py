"""Hugging Face interop for the d9d MoE decoder: ``transformers`` Qwen3-MoE folders.

A d9d :class:`~d9d.models.MoE` with ``qk_norm``, softmax routing, no shared experts, no group
limit and no scaling computes what ``Qwen3MoeForCausalLM`` computes. Weights are stored as on
the Hub, one ``gate_proj``/``up_proj``/``down_proj`` per expert (``transformers`` merges them
when it loads); d9d stacks them as ``[E, dim, expert_dim]`` (the transpose of a linear's
weight). ``tests/checkpoint/test_hf_moe.py`` proves equal logits both ways.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..errors import ConfigError, ParamTreeMismatchError
from ..models import MoEConfig
from ..moe import MoEConfig as LayerConfig
from ._hf import without_tied_head
from ._hf_fields import FieldRules, check_fields
from ._safetensors_read import (
    Stored,
    load_whole,
    read_placed,
    refuse_unconverted,
    safetensors_files,
)

__all__ = [
    "export_hf_moe",
    "import_hf_moe",
    "moe_config",
    "moe_from_hf",
    "moe_sources",
    "moe_to_hf",
]

_SHARED_KEYS = (  # (d9d template, Hugging Face template), {i}: layer
    ("embed.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attn.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attn.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attn.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attn.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.mlp.w_gate.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.w_up.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.mlp.w_down.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.mlp.router.weight", "model.layers.{i}.mlp.gate.weight"),
    ("norm.weight", "model.norm.weight"),
    ("head.weight", "lm_head.weight"),
)
_EXPERT_NAMES = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))

# config.json field -> MoEConfig field (moe.*: the MoE layers' config).
_CONFIG_KEYS = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "dim"),
    ("intermediate_size", "ffn_dim"),
    ("num_hidden_layers", "n_layers"),
    ("num_attention_heads", "n_heads"),
    ("num_key_value_heads", "n_kv_heads"),
    ("head_dim", "head_dim"),
    ("max_position_embeddings", "max_seq_len"),
    ("rms_norm_eps", "norm_eps"),
    ("tie_word_embeddings", "tie_embeddings"),
    ("initializer_range", "init_std"),
    ("pad_token_id", "pad_token_id"),
    ("num_local_experts", "moe.n_experts"),
    ("num_experts_per_tok", "moe.top_k"),
    ("moe_intermediate_size", "moe.expert_dim"),
    ("norm_topk_prob", "moe.norm_topk"),
    ("router_aux_loss_coef", "moe.aux_loss_coef"),
)
_MODEL = "d9d's MoE"
QWEN3_MOE_FIELDS = FieldRules(
    model=_MODEL,
    model_type="qwen3_moe",
    read={
        **{theirs: f"MoEConfig.{ours}" for theirs, ours in _CONFIG_KEYS},
        "num_experts": "num_local_experts' other name",
        "decoder_sparse_step": "must be 1 (checked)",
        "mlp_only_layers": "MoEConfig.n_dense_layers: must be the first layers (checked)",
        "rope_parameters": "rope_theta; a rope_type other than 'default' is refused",
        "rope_theta": "rope_parameters' older spelling",
        "rope_scaling": "rope_parameters' older spelling; any scaling is refused",
        "max_window_layers": "read by transformers only with use_sliding_window=True (refused)",
        "output_router_logits": "whether transformers returns the router logits and adds "
        "their aux loss to its loss given labels; d9d's MoE returns its aux loss always",
    },
    required={"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
)
"""What d9d's MoE does with each field of ``transformers.Qwen3MoeConfig``; every other field
must keep its default (:func:`~d9d.checkpoint._hf_fields.check_fields`)."""

# Fields of d9d's configs with no place in a Qwen3-MoE config.json, and the one value
# Qwen3-MoE computes; other fields are written (_CONFIG_KEYS) or do not change the math.
_QWEN3_VALUES = {"qk_norm": True, "score_func": "softmax", "routed_scaling_factor": 1.0}
_UNWRITTEN = {
    "n_dense_layers": "written as mlp_only_layers",
    "rope_theta": "written as rope_parameters",
    "seed": "the init's seed: the weights are written",
    "moe.dim": "equals dim (MoEConfig checks it)",
    "moe.bias_update_rate": "a bias-free export is checked on the router biases themselves",
    "moe.z_loss_coef": "a loss term of training, like the aux loss; the logits do not see it",
}


def _check_qwen3(config: MoEConfig) -> None:
    """Every field of ``config`` and ``config.moe`` that a Qwen3-MoE folder does not write is
    at its default or at ``_QWEN3_VALUES``: a field d9d adds later fails safe."""
    written = {ours for _, ours in _CONFIG_KEYS} | set(_UNWRITTEN)
    values = {f.name: (getattr(config, f.name), f.default) for f in dataclasses.fields(config)}
    for f in dataclasses.fields(config.moe):
        values[f"moe.{f.name}"] = (getattr(config.moe, f.name), f.default)
    del values["moe"]
    for name, (got, default) in values.items():
        want = _QWEN3_VALUES.get(name.removeprefix("moe."), default)
        if name not in written and got != want:
            raise ConfigError(
                f"A Qwen3-MoE checkpoint needs {name.removeprefix('moe.')}={want!r}, the "
                f"config has {name}={got!r}; only Qwen3-MoE-shaped d9d MoE models convert."
            )


def _layer_keys(config: MoEConfig) -> list[tuple[str, str]]:
    pairs = []
    for ours, theirs in _SHARED_KEYS:
        if "{i}" not in ours:
            if ours != "head.weight" or not config.tie_embeddings:
                pairs.append((ours, theirs))
            continue
        for i in range(config.n_layers):
            dense = i < config.n_dense_layers
            if ".mlp." in ours and (ours.endswith("router.weight") == dense):
                continue
            pairs.append((ours.format(i=i), theirs.format(i=i)))
    return pairs


def moe_to_hf(params: Mapping[str, torch.Tensor], config: MoEConfig) -> dict[str, torch.Tensor]:
    """d9d MoE params as a Qwen3-MoE state dict in the Hub's per-expert layout.

    Raises:
        ConfigError: The config is not Qwen3-MoE-shaped, or a router bias is not zero (it
            changes the routing, which Qwen3-MoE has no place for).
        ParamTreeMismatchError: ``params`` lacks a param of the config, or holds one the
            config has not.

    Example:
        >>> import d9d
        >>> from d9d.models import MoE
        >>> cfg = MoEConfig.tiny(qk_norm=True, moe=LayerConfig(dim=64, n_experts=4, top_k=2,
        ...                      expert_dim=32))
        >>> state = moe_to_hf(d9d.functionalize(MoE(cfg)).params, cfg)
        >>> state["model.layers.1.mlp.experts.3.down_proj.weight"].shape
        torch.Size([64, 32])
    """
    _check_qwen3(config)
    missing = [k for k, _ in _layer_keys(config) if k not in params]
    unexpected = sorted(set(params) - set(moe_sources(config, set())))
    if missing or unexpected:
        raise ParamTreeMismatchError(
            f"moe_to_hf: params lack {missing[:4]} of the config and hold {unexpected[:4]}, "
            "which it has no place for (the export would drop them); pass the params of a "
            "model of this config."
        )
    state = {theirs: params[ours] for ours, theirs in _layer_keys(config)}
    for i in range(config.n_dense_layers, config.n_layers):
        bias = params.get(f"layers.{i}.mlp.router.expert_bias")
        if bias is not None and bool((bias != 0).any()):
            raise ConfigError(
                f"layers.{i}.mlp.router.expert_bias is not zero; Qwen3-MoE routes without a "
                "bias, so the exported model would route differently"
            )
        for ours, theirs in _EXPERT_NAMES:
            stacked = params[f"layers.{i}.mlp.experts.{ours}"]
            for e in range(config.moe.n_experts):
                key = f"model.layers.{i}.mlp.experts.{e}.{theirs}.weight"
                state[key] = stacked[e].t()
    return state


def moe_from_hf(state: Mapping[str, torch.Tensor], config: MoEConfig) -> dict[str, torch.Tensor]:
    """A Qwen3-MoE state dict (per-expert Hub keys, or ``transformers``' merged
    ``experts.gate_up_proj``/``experts.down_proj``) as d9d MoE params of ``config``.

    Raises:
        ParamTreeMismatchError: A weight of the config is missing, a stored tensor has no
            param in the model, or a tied head differs from the embedding.

    Example:
        >>> import d9d, torch
        >>> from d9d.models import MoE
        >>> cfg = MoEConfig.tiny(qk_norm=True, moe=LayerConfig(dim=64, n_experts=4, top_k=2,
        ...                      expert_dim=32))
        >>> params = d9d.functionalize(MoE(cfg)).params
        >>> back = moe_from_hf(moe_to_hf(params, cfg), cfg)
        >>> sorted(back) == sorted(params) and all(torch.equal(back[k], params[k]) for k in params)
        True
    """
    state = without_tied_head(state, config.tie_embeddings)
    refuse_unconverted(state, moe_sources(config, set(state)), _MODEL)
    missing = [theirs for _, theirs in _layer_keys(config) if theirs not in state]
    if missing:
        raise ParamTreeMismatchError(
            f"the Hugging Face weights lack {missing[:4]} of the config ({len(missing)} in all)"
        )
    params = {ours: state[theirs] for ours, theirs in _layer_keys(config)}
    n_experts, hidden = config.moe.n_experts, config.moe.expert_dim
    for i in range(config.n_dense_layers, config.n_layers):
        prefix = f"model.layers.{i}.mlp.experts"
        if f"{prefix}.gate_up_proj" in state:
            gate_up, down = state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"]
            stacked = {
                "w_gate": gate_up[:, :hidden],
                "w_up": gate_up[:, hidden:],
                "w_down": down,
            }
        else:
            stacked = {}
            for ours, theirs in _EXPERT_NAMES:
                keys = [f"{prefix}.{e}.{theirs}.weight" for e in range(n_experts)]
                absent = [k for k in keys if k not in state]
                if absent:
                    raise ParamTreeMismatchError(f"the Hugging Face weights lack {absent[:2]}")
                stacked[ours] = torch.stack([state[k] for k in keys])
        for ours, weight in stacked.items():
            params[f"layers.{i}.mlp.experts.{ours}"] = weight.transpose(1, 2).contiguous()
        if config.moe.bias_update_rate > 0:
            router = params[f"layers.{i}.mlp.router.weight"]
            params[f"layers.{i}.mlp.router.expert_bias"] = router.new_zeros(n_experts)
    return params


def _hf_config(config: MoEConfig, dtype: torch.dtype) -> dict[str, Any]:
    hf = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **{theirs: _get(config, ours) for theirs, ours in _CONFIG_KEYS},
        "head_dim": config.attention_head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(config.n_dense_layers)),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    check_fields(hf, QWEN3_MOE_FIELDS)  # a field transformers adds with another default
    return hf


def _get(config: MoEConfig, path: str) -> Any:
    owner, _, name = path.rpartition(".")
    return getattr(config.moe if owner else config, name)


def export_hf_moe(
    params: Mapping[str, torch.Tensor], config: MoEConfig, path: str | os.PathLike[str]
) -> Path:
    """Write a d9d MoE model as a ``transformers`` Qwen3-MoE folder (``config.json`` and
    ``model.safetensors``); ``Qwen3MoeForCausalLM.from_pretrained(path)`` then computes the
    same logits. DTensors are gathered (every rank calls this); rank 0 writes.

    Raises:
        ConfigError: The config is not Qwen3-MoE-shaped, or a router bias is not zero.
        ParamTreeMismatchError: ``params`` lacks a param of the config, or holds one the
            config has not.

    Example:
        >>> import tempfile, d9d
        >>> from d9d.models import MoE
        >>> cfg = MoEConfig.tiny(qk_norm=True, moe=LayerConfig(dim=64, n_experts=4, top_k=2,
        ...                      expert_dim=32))
        >>> folder = export_hf_moe(d9d.functionalize(MoE(cfg)).params, cfg, tempfile.mkdtemp())
        >>> sorted(p.name for p in folder.iterdir())
        ['config.json', 'model.safetensors']
    """
    from safetensors.torch import save_file

    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
        for k, v in params.items()
    }
    state = {k: v.contiguous() for k, v in moe_to_hf(full, config).items()}
    path = Path(path)
    if dist.is_initialized() and dist.get_rank() != 0:
        return path
    path.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(state.values())).dtype
    (path / "config.json").write_text(json.dumps(_hf_config(config, dtype), indent=2) + "\n")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def moe_config(hf: dict[str, Any]) -> MoEConfig:
    """The d9d :class:`~d9d.models.MoEConfig` of a Qwen3-MoE ``config.json`` dict.

    Raises:
        ConfigError: Another ``model_type``, or a field d9d's MoE does not implement
            (:data:`QWEN3_MOE_FIELDS`), named with its value.
    """
    if hf.get("model_type") != "qwen3_moe":
        raise ConfigError(f"config.json has model_type={hf.get('model_type')!r}, not 'qwen3_moe'.")
    hf = check_fields(hf, QWEN3_MOE_FIELDS)
    step, only = hf["decoder_sparse_step"], hf["mlp_only_layers"]
    if step != 1 or only != list(range(len(only))):
        raise ConfigError(
            f"config.json has decoder_sparse_step={step}, mlp_only_layers={only}; d9d's MoE "
            "needs the dense layers first: decoder_sparse_step=1, mlp_only_layers=[0..k-1]."
        )
    rope = hf["rope_parameters"]
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(
            f"The checkpoint uses RoPE scaling ({rope}), which d9d's MoE does not implement; "
            "only rope_type 'default' loads."
        )
    fields: dict[str, Any] = {"moe": {"dim": hf["hidden_size"]}}
    for theirs, ours in _CONFIG_KEYS:
        owner, _, name = ours.rpartition(".")
        (fields["moe"] if owner else fields)[name] = hf.get(theirs)
    return MoEConfig(
        **fields | {"moe": LayerConfig(**fields["moe"])},
        n_dense_layers=len(only),
        qk_norm=True,
        rope_theta=float(rope["rope_theta"]),
    )


def moe_sources(config: MoEConfig, stored: set[str]) -> dict[str, Stored]:
    """``{d9d param path: Stored}``: where each MoE param lies among the ``stored`` keys of a
    Qwen3-MoE folder (per-expert Hub keys, or ``transformers``' merged experts)."""
    sources = {ours: Stored((theirs,)) for ours, theirs in _layer_keys(config)}
    n_experts, hidden = config.moe.n_experts, config.moe.expert_dim
    for i in range(config.n_dense_layers, config.n_layers):
        prefix, ours = f"model.layers.{i}.mlp.experts", f"layers.{i}.mlp.experts"
        if f"{prefix}.gate_up_proj" in stored:
            merged = (f"{prefix}.gate_up_proj",)
            sources[f"{ours}.w_gate"] = Stored(merged, transposed=True, start=(0, 0, 0))
            sources[f"{ours}.w_up"] = Stored(merged, transposed=True, start=(0, hidden, 0))
            sources[f"{ours}.w_down"] = Stored((f"{prefix}.down_proj",), transposed=True)
        else:
            for name, theirs in _EXPERT_NAMES:
                keys = tuple(f"{prefix}.{e}.{theirs}.weight" for e in range(n_experts))
                sources[f"{ours}.{name}"] = Stored(keys, stacked=True, transposed=True)
        sources[f"layers.{i}.mlp.router.expert_bias"] = Stored(())
    return sources


def import_hf_moe(
    path: str | os.PathLike[str], target: Any = None
) -> tuple[MoEConfig, dict[str, Any]]:
    """Read a ``transformers`` Qwen3-MoE folder as ``(config, params)`` of a d9d MoE model.

    Reads ``model.safetensors`` or every file ``model.safetensors.index.json`` lists. With
    ``target`` (placed params, e.g. ``step.place`` of a model built on the ``meta`` device),
    each rank reads only its shards' slices (of each expert, transposed as it is read),
    never the whole model; the values equal the full import's.

    Args:
        path: A Qwen3-MoE folder (``save_pretrained`` or :func:`export_hf_moe`).
        target: ``{d9d path: DTensor, tensor or Abstract}`` giving each param's layout and
            dtype; ``None`` reads every param whole.

    Returns:
        ``(config, params)``; with ``target``, params of ``target``'s structure holding
        this rank's shards.

    Raises:
        FileNotFoundError: A weights file is missing.
        ConfigError: A config field d9d's MoE does not implement (RoPE scaling, sparse steps,
            ``attention_bias=True``, a sliding window, ``hidden_act`` other than silu, a field
            ``transformers.Qwen3MoeConfig`` does not define...), named with its value.
        ParamTreeMismatchError: The weights do not match the config.
        ParamShapeError: With ``target``, a stored tensor's shape does not fit its param.

    Example:
        >>> import tempfile, d9d
        >>> from d9d.models import MoE
        >>> cfg = MoEConfig.tiny(qk_norm=True, moe=LayerConfig(dim=64, n_experts=4, top_k=2,
        ...                      expert_dim=32))
        >>> folder = export_hf_moe(d9d.functionalize(MoE(cfg)).params, cfg, tempfile.mkdtemp())
        >>> config, params = import_hf_moe(folder)
        >>> config.moe.n_experts, params["layers.1.mlp.experts.w_gate"].shape
        (4, torch.Size([4, 64, 32]))
    """
    path = Path(path)
    config = moe_config(json.loads((path / "config.json").read_text()))
    if target is not None:
        stored = set(safetensors_files(path))
        sources = moe_sources(config, stored)
        tied = ["lm_head.weight"] if config.tie_embeddings else []  # not read, as the Llama's
        refuse_unconverted(stored, sources, _MODEL, also=tied)
        return config, read_placed(path, target, sources)
    state = load_whole(path)
    return config, moe_from_hf(state, config)
