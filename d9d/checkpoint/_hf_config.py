"""``read_hf_config``: the d9d model config of a ``transformers`` folder, before any weight."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import ConfigError
from ..models import LlamaConfig, MoEConfig
from ._hf import llama_config
from ._hf_moe import moe_config

__all__ = ["read_hf_config"]


def read_hf_config(path: str | os.PathLike[str]) -> LlamaConfig | MoEConfig:
    """The d9d config of the ``transformers`` folder ``path``, from its ``config.json`` only.

    Build the model from it on the ``meta`` device, place it, and read the weights with
    ``import_hf(path, target=placed)`` (or :func:`import_hf_moe`): no rank allocates the
    whole model.

    Args:
        path: A folder with a ``config.json`` of ``model_type`` ``llama`` or ``qwen3_moe``.

    Returns:
        A :class:`~d9d.models.LlamaConfig` (``llama``) or :class:`~d9d.models.MoEConfig`
        (``qwen3_moe``).

    Raises:
        FileNotFoundError: ``config.json`` is missing.
        ConfigError: Another ``model_type``, or a model d9d does not implement.

    Example:
        >>> import tempfile
        >>> from d9d import functionalize
        >>> from d9d.checkpoint import export_hf
        >>> from d9d.models import Llama
        >>> folder = export_hf(functionalize(Llama(LlamaConfig.tiny())).params,
        ...                    LlamaConfig.tiny(), tempfile.mkdtemp())
        >>> read_hf_config(folder) == LlamaConfig.tiny()
        True
    """
    hf = json.loads((Path(path) / "config.json").read_text())
    match hf.get("model_type"):
        case "llama":
            return llama_config(hf)
        case "qwen3_moe":
            return moe_config(hf)
        case other:
            raise ConfigError(
                f"config.json has model_type={other!r}; d9d's own models read 'llama' and "
                "'qwen3_moe' folders. Functionalize other transformers models as they are "
                "and read their weights with d9d.checkpoint.load_hf_weights."
            )
