"""Logical axes from ``transformers``' own tensor-parallel plans (``config.base_model_tp_plan``).

``transformers`` keeps, with each family, a plan of module-path patterns
(``"layers.*.self_attn.q_proj"``) to a style (``"colwise"``, ``"rowwise"``, ...). Each style
names how its module is cut over the tensor-parallel ranks, which is what d9d's logical axes
say: the rules below turn one into the other. Styles d9d does not implement get a logical axis
that names them, which ``tensor_parallel`` refuses with the param's path (every other
transform ignores axis names), so a plan is never half followed in silence.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from torch import nn

__all__ = ["IMPLEMENTED_STYLES", "generalize", "plan_rules"]

Axes = tuple[str | None, ...]

# An attention module's column-parallel linears split heads (q: heads, k/v: kv_heads), its
# row-parallel one reads them; every other module's split the MLP's hidden width.
_ATTENTION = re.compile(r"(attn|attention)\.")
_KEY_VALUE = re.compile(r"(^|\.)([kv]_proj|key|value)$")

IMPLEMENTED_STYLES: Mapping[str, str] = MappingProxyType(
    {
        "colwise": "weight [out, in]: out over tp (heads, kv_heads or mlp); bias as out",
        "rowwise": "weight [out, in]: in over tp; bias replicated (added once, after the sum)",
        "colwise_gather_output": "the output head: vocab-parallel (d9d's loss reads it sharded); "
        "elsewhere (Olmo2's q/k/v, whose norms span all heads) whole on tp",
        "rowwise_split_input": "the projection after a gathered output (Olmo2's o_proj): whole",
        "embedding_rowwise": "the embedding: vocab-parallel",
        "embedding_colwise": "the embedding: vocab-parallel (d9d's one embedding layout, exact too)",
        "replicated_with_grad_allreduce": "replicated, grads summed over tp (per-head norms)",
        "replicate": "replicated",
        "mla_kv_a_proj": "latent attention's kv down-projection: replicated (latent), its grads "
        "summed over tp, as it feeds the rank's heads only",
        "moe_tp_experts": "routed experts replicated over tp, as d9d.moe (experts, expert_mlp)",
    }
)
"""``{style: what d9d does with it}``; a style not here is refused by name under tp."""


def plan_rules(module: nn.Module) -> dict[str, Axes]:
    """``{param path regex: logical axes}`` for the params of ``module`` that its
    ``transformers`` tp plan names (``config.base_model_tp_plan`` under the base model's
    prefix, and the model class's own ``_tp_plan``, ``lm_head`` for causal LMs); ``{}`` without
    a plan.

    Example:
        >>> import transformers
        >>> config = transformers.GraniteConfig(
        ...     vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=1)
        >>> rules = plan_rules(transformers.GraniteForCausalLM(config))
        >>> rules[r"^model\\.layers\\.\\d+\\.self_attn\\.o_proj\\.weight$"]
        ('embed', 'heads')
    """
    plan = _plan(module)
    head_dims = _head_dims(getattr(module, "config", None))
    rules: dict[str, Axes] = {}
    for path, param in module.named_parameters():
        owner, _, name = path.rpartition(".")
        style = _style(plan, owner)
        if style in (None, "local_params"):  # a module's own param that the plan names itself
            style = _style(plan, path) or style
        if style is not None:
            axes = _axes(style, owner, name, tuple(param.shape), head_dims)
            rules["^" + re.escape(path) + "$"] = axes
        elif (axes := _norm_of_projection(module, plan, owner, tuple(param.shape))) is not None:
            rules["^" + re.escape(path) + "$"] = axes
    return generalize(rules)


def _style(plan: list[tuple[re.Pattern[str], str]], owner: str) -> str | None:
    return next((style for pattern, style in plan if pattern.match(owner)), None)


def _norm_of_projection(
    module: nn.Module, plan: list[tuple[re.Pattern[str], str]], owner: str, shape: tuple[int, ...]
) -> Axes | None:
    """The axes of a norm that the plan leaves out and that acts on the whole output of a
    sibling projection (Olmo2's q_norm/k_norm over all heads): replicated where the plan
    keeps that projection's output whole (colwise_gather_output), refused by name where it
    shards it (the norm's statistics would span ranks); None for any other param."""
    if len(shape) != 1 or not type(module.get_submodule(owner)).__name__.endswith("Norm"):
        return None
    parent = owner.rpartition(".")[0]
    styles = {
        _style(plan, f"{parent}.{name}" if parent else name)
        for name, child in module.get_submodule(parent).named_children()
        if isinstance(child, nn.Linear) and child.out_features == shape[0]
    }
    styles = {s for s in styles if s is not None and not s.startswith("rowwise")}
    if not styles:
        return None
    if styles == {"colwise_gather_output"}:
        return ("embed",)
    return (
        f"norm over the output of a {'/'.join(sorted(styles))} projection, whose heads span "
        "the tp ranks (not implemented by d9d)",
    )


def _plan(module: nn.Module) -> list[tuple[re.Pattern[str], str]]:
    config = getattr(module, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(module, "base_model_prefix", "")
    if prefix and not hasattr(module, prefix):
        prefix = ""  # the module is the base model itself
    own = getattr(module, "_tp_plan", None) or {}
    entries = {(f"{prefix}.{k}" if prefix else k): v for k, v in base.items()}
    entries.update(
        {k: v for k, v in own.items() if not k.startswith(prefix + ".")} if prefix else own
    )
    return [
        (re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$"), style)
        for key, style in entries.items()
    ]


def _head_dims(config: Any) -> frozenset[int]:
    """The attention head sizes of the config's layers, read per layer: a heterogeneous config
    (Gemma-4's full-attention layers, heads of 512 beside 256) refuses a global ``head_dim``."""
    layers = getattr(config, "per_layer_config", None) or ([config] if config is not None else [])
    return frozenset(dim for layer in layers if (dim := _head_dim(layer)))


def _head_dim(config: Any) -> int | None:
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return head_dim
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", 0)
    return hidden // heads if hidden and heads else None


def _axes(
    style: str, owner: str, name: str, shape: tuple[int, ...], head_dims: frozenset[int]
) -> Axes:
    attention = bool(_ATTENTION.search(owner + "."))
    inner = ("kv_heads" if _KEY_VALUE.search(owner) else "heads") if attention else "mlp"
    whole: Axes = ("embed",) * len(shape)
    match style, name, len(shape):
        case "colwise", "weight", 2:
            return (inner, "embed")
        case "colwise", _, 1:  # a bias, or a per-head param of attention (sinks, gate_bias)
            return (inner,)
        case "rowwise", "weight", 2:
            return ("embed", "heads" if attention else "mlp")
        case "rowwise", "bias", 1:
            return ("embed",)
        case "colwise_gather_output", "weight", 2 if owner.endswith("lm_head"):
            return ("vocab", "embed")
        case "colwise_gather_output", _, 1 if owner.endswith("lm_head"):
            return ("vocab",)  # Phi's head has a bias, Dory's a per-token logit_scale
        case (("colwise_gather_output" | "rowwise_split_input"), _, _):
            return whole
        case (("embedding_rowwise" | "embedding_colwise"), "weight", 2):
            return ("vocab", "embed")
        case "replicated_with_grad_allreduce", _, 1 if shape[0] in head_dims:
            return ("head_dim",)
        case (("replicated_with_grad_allreduce" | "replicate"), _, _):
            return whole
        case "mla_kv_a_proj", _, _:
            return ("latent", *whole[1:])
        case "moe_tp_experts", _, 3:
            wide = ("experts", "expert_mlp", "embed")
            return (
                wide
                if name.startswith(("gate_up", "up", "gate"))
                else ("experts", "embed", "expert_mlp")
            )
        case "moe_tp_experts", _, 2:
            return (
                ("experts", "expert_mlp")
                if name.startswith(("gate_up", "up", "gate"))
                else ("experts", "embed")
            )
        case _:
            return (f"tp plan style {style} (not implemented by d9d)", *whole[1:])


def generalize(rules: dict[str, Axes]) -> dict[str, Axes]:
    """One rule per layer-independent path (``model.layers.<i>.`` as ``\\d+``) when every layer
    agrees, so that ``model.axes`` reads like the hand-written tables."""
    general: dict[str, set[Axes]] = {}
    for pattern, axes in rules.items():
        key = re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", pattern)
        general.setdefault(key, set()).add(axes)
    if all(len(v) == 1 for v in general.values()):
        return {key: next(iter(v)) for key, v in general.items()}
    return rules
