"""The blocks of a Hugging Face model, from ``transformers``' own pipeline plan.

``config.base_model_pp_plan`` names the base model's children in pipeline order
(``{"embed_tokens": ..., "layers": ..., "norm": ...}``); the ``nn.ModuleList`` among them holds
the blocks a pipeline cuts between, and that ``tensor_parallel`` and ``remat`` treat as blocks.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ._detect import is_hf_model

__all__ = ["block_lists_for"]


def block_lists_for(module: Any) -> tuple[str, ...]:
    """Paths of the ``nn.ModuleList``s that the model's ``transformers`` pipeline plan names
    (under the base model's prefix); ``()`` for a model without one, or any other module.

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(
        ...     vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=1)
        >>> block_lists_for(transformers.LlamaForCausalLM(config))
        ('model.layers',)
    """
    module = getattr(module, "module", module)
    if not is_hf_model(module):
        return ()
    plan = getattr(getattr(module, "config", None), "base_model_pp_plan", None) or {}
    prefix = getattr(module, "base_model_prefix", "")
    if not prefix or not isinstance(getattr(module, prefix, None), nn.Module):
        prefix = ""  # the module is the base model itself
    found = []
    for name in plan:
        path = f"{prefix}.{name}" if prefix else name
        try:
            child = module.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(child, nn.ModuleList):
            found.append(path)
    return tuple(found)
