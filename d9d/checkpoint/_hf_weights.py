"""``load_hf_weights``: the shards of a functionalized ``transformers`` model, from its folder."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .. import tree as tree_lib
from ._safetensors_read import Stored, read_placed, safetensors_files

__all__ = ["load_hf_weights"]


def load_hf_weights(
    path: str | os.PathLike[str], target: Any, *, tied: Mapping[str, str] | None = None
) -> Any:
    """Read each rank's shards of a ``transformers`` model's params from its safetensors.

    The params of ``d9d.functionalize(hf_model)`` are the model's own state-dict keys, so
    each param is read from the stored tensor of its name: only the slice of this rank's
    shard (``safe_open(...).get_slice``), one tensor at a time, so no rank holds the model.
    A param a folder stores under another name of a tied weight (``save_pretrained`` keeps
    one of ``lm_head.weight`` and ``model.embed_tokens.weight``) is read from that name.

    Args:
        path: A ``save_pretrained`` folder (``model.safetensors`` or an indexed set).
        target: ``{param path: DTensor, tensor or Abstract}``: the layout and dtype of each
            param, e.g. ``step.place`` of the params of a model built on ``meta``.
        tied: ``{alias path: canonical path}`` of tied params (``model.tied``); default none.

    Returns:
        ``target``'s structure holding this rank's shards (DTensors) or tensors, in the
        target's dtypes.

    Raises:
        FileNotFoundError: A weights file is missing.
        ParamTreeMismatchError: A param is stored under none of its names.
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
    for param, _ in leaves:
        key = next((k for k in (param, *names.get(param, ())) if k in stored), param)
        sources[param] = Stored((key,))
    return read_placed(path, target, sources)
