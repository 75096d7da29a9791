"""Which Hugging Face family a module is, and the logical-axis rules d9d gives it.

Detection reads class ``__module__`` names and ``config.model_type``: ``transformers`` is never
imported here, so ``import d9d`` stays free of it.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from torch import nn

from ._detect import is_hf_model
from ._families import FAMILIES, FILL, POSITION_WISE, ROUTERS
from ._kept_whole import kept_whole_rules
from ._tp_plan import generalize, plan_rules

__all__ = ["apply_defaults", "axes_for", "family_of", "is_hf_model", "position_wise_for"]

_MODELING = re.compile(r"^transformers\.models\.(\w+)\.modeling_\w+$")


def family_of(module: nn.Module) -> str | None:
    """The family of a ``transformers`` model: its ``config.model_type`` (``"llama"``), else
    the package its class comes from; None for any other module.

    Example:
        >>> family_of(nn.Linear(2, 2)) is None
        True
    """
    if not is_hf_model(module):
        return None
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if isinstance(model_type, str) and model_type:
        return model_type
    for cls in type(module).__mro__:
        found = _MODELING.match(cls.__module__)
        if found:
            return found.group(1)
    return None


def axes_for(module: Any) -> dict[str, tuple[str | None, ...]]:
    """The logical-axis rules ``d9d.functionalize`` gives a Hugging Face model by itself.

    The hand-written rules of its family (a key of :data:`d9d.hf.FAMILIES`, where they add
    to the plan), then those of the model's own ``transformers`` tensor-parallel plan
    (``config.base_model_tp_plan``, see :func:`d9d.hf.plan_rules`), then, for a model that
    has a plan, Llama-layout rules for what it leaves out (:data:`d9d.hf.FILL`), then ``(experts,
    embed)`` for MoE routers (``mlp.gate.weight``); before all of these, for a model that has
    a plan, ``("embed",) * ndim`` (whole on tp, as ``transformers`` replicates a module its
    plan leaves out) for every param of a block child that holds an ``nn.Conv1d`` (a mamba or
    linear-attention mixer) or none of whose params those rules name; then ``("embed",)`` for the weight and
    bias of every norm (a class named ``*RMSNorm`` or ``*LayerNorm``, or an ``nn.LayerNorm``) over
    the hidden size. Rules ``functionalize`` is given with ``axes=``
    come first; these fill what they leave. Only rules that match a param of ``module`` are
    returned. A model with no plan and no table gets its norm rules only: give its
    linears rules with ``d9d.functionalize(model, axes={...})``.

    Args:
        module: A ``transformers`` model (or the :class:`d9d.Model` of one).

    Returns:
        ``{path regex: logical axis names}``, first match wins; ``{}`` for a module that is
        not a ``transformers`` model.

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(
        ...     vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=1)
        >>> rules = axes_for(transformers.LlamaForCausalLM(config))
        >>> rules[r"^model\\.layers\\.\\d+\\.self_attn\\.q_proj\\.weight$"]
        ('heads', 'embed')
    """
    module = getattr(module, "module", module)
    family = family_of(module)
    if family is None:
        return {}
    paths = [path for path, _ in module.named_parameters()]
    rules = dict(FAMILIES.get(family, {}))
    planned = plan_rules(module)
    rules.update({k: v for k, v in planned.items() if k not in rules})
    if planned:
        rules.update({k: v for k, v in FILL.items() if k not in rules})
        rules.update({k: v for k, v in _expert_rules(module).items() if k not in rules})
    rules.update({k: v for k, v in ROUTERS.items() if k not in rules})
    if planned:
        kept = kept_whole_rules(module, rules)  # before the rules it overrides
        rules = {**kept, **{k: v for k, v in rules.items() if k not in kept}}
    rules.update(_norm_rules(module))
    return {p: a for p, a in rules.items() if any(re.search(p, path) for path in paths)}


def position_wise_for(module: Any) -> tuple[str, ...]:
    """Paths of the modules of a Hugging Face model that its family's entry in
    :data:`d9d.hf.POSITION_WISE` declares position-wise (their class named there); ``()`` for
    any other module.

    Example:
        >>> position_wise_for(nn.Linear(2, 2))
        ()
    """
    module = getattr(module, "module", module)
    names = POSITION_WISE.get(family_of(module) or "", ())
    return tuple(p for p, m in module.named_modules() if type(m).__name__ in names)


def apply_defaults(module: nn.Module) -> dict[str, Any]:
    """Keyword arguments ``Model.apply`` passes a Hugging Face model unless the caller does:
    ``use_cache=False`` where its forward takes ``use_cache``; ``{}`` for any other module.

    A training step has no use for the key/value cache, which ``transformers`` builds by
    default (``config.use_cache``): it would hold every layer's keys and values to the end of
    the forward, so that ``remat`` could not free them, and a recomputed block would append
    to it a second time (which torch's selective checkpoint refuses: its ops differ).

    Example:
        >>> apply_defaults(nn.Linear(2, 2))
        {}
    """
    if is_hf_model(module) and "use_cache" in inspect.signature(module.forward).parameters:
        return {"use_cache": False}
    return {}


def _expert_rules(module: nn.Module) -> dict[str, tuple[str | None, ...]]:
    """Axes of the fused routed-expert params that the plan leaves out (GPT-OSS's
    ``mlp.experts.gate_up_proj [E, H, 2I]`` and their biases ``[E, 2I]``), by shape:
    ``experts``, then ``embed`` for the dim of the hidden size and ``expert_mlp`` for the
    other; none where a weight's two dims are both or neither the hidden size (which is which
    is then unknown). Whole on tp, as ``moe_tp_experts`` keeps them."""
    hidden = getattr(getattr(module, "config", None), "hidden_size", None)
    rules: dict[str, tuple[str | None, ...]] = {}
    for path, param in module.named_parameters():
        if not re.search(r"(^|\.)experts\.\w+$", path) or param.ndim not in (2, 3):
            continue
        dims = tuple(param.shape[1:])
        if len(dims) == 2 and dims.count(hidden) != 1:
            continue
        inner = tuple("embed" if d == hidden else "expert_mlp" for d in dims)
        rules["^" + re.escape(path) + "$"] = ("experts", *inner)
    return generalize(rules)


def _norm_rules(module: nn.Module) -> dict[str, tuple[str | None, ...]]:
    """``("embed",)`` for each param of a norm over the hidden size, one rule per attribute
    name (``input_layernorm.weight``) when every param of that name is such a norm's, else one
    per path. A norm of another size (per head, say) gets none: which of its dims a transform
    may split is the family's call."""
    hidden = getattr(getattr(module, "config", None), "hidden_size", None)
    norms: dict[str, list[str]] = {}
    others: set[str] = set()
    for path, owner in module.named_modules():
        is_norm = type(owner).__name__.endswith(("RMSNorm", "LayerNorm")) or isinstance(
            owner, nn.LayerNorm
        )
        for name, param in owner.named_parameters(recurse=False):
            key = f"{path}.{name}" if path else name
            suffix = ".".join(key.split(".")[-2:])
            if is_norm and name in ("weight", "bias") and param.shape == (hidden,):
                norms.setdefault(suffix, []).append(key)
            else:
                others.add(suffix)
    rules: dict[str, tuple[str | None, ...]] = {}
    for suffix, keys in norms.items():
        if "." in suffix and suffix not in others:
            rules[r"(^|\.)" + re.escape(suffix) + "$"] = ("embed",)
        else:
            rules.update({"^" + re.escape(key) + "$": ("embed",) for key in keys})
    return rules
