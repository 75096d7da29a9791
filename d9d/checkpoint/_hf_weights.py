"""``load_hf_weights``: the shards of a functionalized ``transformers`` model, from its folder."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from .. import tree as tree_lib
from ..errors import ParamTreeMismatchError
from ._safetensors_read import (
    RECOMPUTED,
    Concatenated,
    Source,
    Stored,
    ignored_on_load,
    read_placed,
    safetensors_files,
    stored_keys,
)

__all__ = ["load_hf_weights"]

# transformers 5 holds routed experts merged (``experts.gate_up_proj [E, 2I, H]``,
# ``experts.down_proj [E, H, I]``) but saves them per expert, as on the Hub.
_MERGED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<name>gate_up_proj|down_proj)$")


def _per_expert(param: str, shape: tuple[int, ...], stored: set[str]) -> Source | None:
    """The per-expert stored source of a merged expert param, if the folder has one."""
    found = _MERGED_EXPERTS.match(param)
    if found is None or len(shape) != 3:
        return None

    def stacked(name: str) -> Stored:
        return Stored(
            tuple(f"{found['prefix']}.{e}.{name}.weight" for e in range(shape[0])), stacked=True
        )

    if found["name"] == "down_proj":
        source: Source = stacked("down_proj")
    else:
        half = shape[1] // 2
        source = Concatenated(1, ((half, stacked("gate_proj")), (half, stacked("up_proj"))))
    parts = source.parts if isinstance(source, Concatenated) else ((0, source),)
    return source if all(set(part.keys) <= stored for _, part in parts) else None


def _refuse_unread(
    path: str | os.PathLike[str],
    stored: set[str],
    sources: Mapping[str, Source],
    aliases: set[str],
) -> None:
    """Raise unless every stored tensor is read by a target leaf, is another name of a tied
    one, is a recomputed ``rotary_emb.inv_freq``, or is one ``transformers`` skips when it
    loads the folder's model (``ignored_on_load``)."""
    read = {key for source in sources.values() for key in stored_keys(source)} | aliases
    skipped = (RECOMPUTED, *ignored_on_load(path))
    unread = sorted(k for k in stored if k not in read and not any(p.search(k) for p in skipped))
    if unread:
        raise ParamTreeMismatchError(
            f"Stored tensors {unread[:10]} ({len(unread)} in all) are read by no leaf of the "
            "target, so the load would drop them. A persistent buffer the model reads "
            "(DeepSeek-V3's mlp.gate.e_score_correction_bias) goes in the target beside the "
            "params (the model's buffers at those paths, e.g. {**target, **{k: "
            "model.buffers[k] for k in model.module.state_dict() if k in model.buffers}}), "
            "then into the module that trains; a tensor the model has no place for (a bias "
            "its config lacks) means the folder is another model's; a target holding part of "
            "the model (a pipeline stage's params) passes partial=True."
        )


def load_hf_weights(
    path: str | os.PathLike[str],
    target: Any,
    *,
    tied: Mapping[str, str] | None = None,
    partial: bool = False,
) -> Any:
    """Read each rank's shards of a ``transformers`` model's params from its safetensors.

    The params of ``d9d.functionalize(hf_model)`` are the model's own state-dict keys, so
    each param is read from the stored tensor of its name: only the slice of this rank's
    shard (``safe_open(...).get_slice``), one tensor at a time, so no rank holds the model.
    A param a folder stores under another name of a tied weight (``save_pretrained`` keeps
    one of ``lm_head.weight`` and ``model.embed_tokens.weight``) is read from that name.
    Routed experts that the model holds merged (``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``, as ``transformers`` 5 does for Qwen3-MoE) and the folder
    per expert (``experts.<e>.gate_proj.weight``...) are read expert by expert.

    Every stored tensor must be read by a leaf of ``target`` (or be another name of a tied
    one, a ``rotary_emb.inv_freq`` that the model recomputes, or one that ``transformers``
    skips when it loads the folder's model: its class's ``_keys_to_ignore_on_load_unexpected``,
    such as DeepSeek-V3's multi-token-prediction layer), unless ``partial``: one
    that no leaf reads would be dropped silently, a persistent buffer the model computes
    with (DeepSeek-V3's ``e_score_correction_bias``, which ``transformers`` saves) or a
    weight of another config. A target leaf may name a buffer as well as a param.

    Args:
        path: A ``save_pretrained`` folder (``model.safetensors`` or an indexed set).
        target: ``{param path: DTensor, tensor or Abstract}``: the layout and dtype of each
            param, e.g. ``step.place`` of the params of a model built on ``meta``.
        tied: ``{alias path: canonical path}`` of tied params (``model.tied``); default none.
        partial: Allow stored tensors that no leaf of ``target`` reads (a pipeline stage
            reading its own params); default ``False``.

    Returns:
        ``target``'s structure holding this rank's shards (DTensors) or tensors, in the
        target's dtypes.

    Raises:
        FileNotFoundError: A weights file is missing.
        ParamTreeMismatchError: A param is stored under none of its names, or (unless
            ``partial``) a stored tensor is read by no leaf of ``target``.
        ParamShapeError: A stored tensor's shape does not fit its param.

    Example:
        >>> import tempfile, torch, transformers, d9d
        >>> config = transformers.LlamaConfig(vocab_size=97, hidden_size=16,
        ...     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
        >>> folder = tempfile.mkdtemp()
        >>> transformers.LlamaForCausalLM(config).save_pretrained(folder)
        >>> with torch.device("meta"):
        ...     model = d9d.functionalize(transformers.LlamaForCausalLM(config))
        >>> params = load_hf_weights(folder, model.params, tied=model.tied)
        >>> params["model.norm.weight"].shape
        torch.Size([16])
    """
    stored = set(safetensors_files(path))
    names: dict[str, list[str]] = {}
    for alias, canonical in (tied or {}).items():
        names.setdefault(canonical, []).append(alias)
    sources = {}
    leaves, _ = tree_lib.flatten_with_paths(target)
    for param, leaf in leaves:
        key = next((k for k in (param, *names.get(param, ())) if k in stored), None)
        experts = None if key else _per_expert(param, tuple(leaf.shape), stored)
        sources[param] = experts or Stored((key or param,))
    # A param stored under none of its names is named first (read_placed), with what the
    # folder lacks; the tensors no leaf reads are then often the same weights, renamed.
    wanted = {key for source in sources.values() for key in stored_keys(source)}
    if not partial and wanted <= stored:
        aliases = {alias for param in sources for alias in names.get(param, ())}
        _refuse_unread(path, stored, sources, aliases)
    return read_placed(path, target, sources)
