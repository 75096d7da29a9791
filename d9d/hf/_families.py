"""Logical-axis rules of the Hugging Face model families d9d knows, keyed by ``model_type``.

Each table maps path regexes (matched with ``re.search`` against param paths such as
``model.layers.0.self_attn.q_proj.weight``) to logical axis names, one per dim. A ``weight`` of
an ``nn.Linear`` is ``[out, in]``; a ``transformers`` ``Conv1D`` weight is ``[in, out]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["FAMILIES", "POSITION_WISE"]

Rules = Mapping[str, tuple[str | None, ...]]

_EMBEDDINGS: Rules = {
    r"(^|\.)embed_tokens\.weight$": ("vocab", "embed"),
    r"(^|\.)lm_head\.weight$": ("vocab", "embed"),
}

_ATTENTION: Rules = {
    r"(^|\.)q_proj\.weight$": ("heads", "embed"),
    r"(^|\.)[kv]_proj\.weight$": ("kv_heads", "embed"),
    r"(^|\.)q_proj\.bias$": ("heads",),
    r"(^|\.)[kv]_proj\.bias$": ("kv_heads",),
    r"(^|\.)o_proj\.weight$": ("embed", "heads"),
    r"(^|\.)o_proj\.bias$": ("embed",),
    # Qwen3's per-head norms act on head_dim: under tensor_parallel each rank normalizes its
    # own heads, so their grads are summed over the axis (head_dim marks that).
    r"(^|\.)[qk]_norm\.weight$": ("head_dim",),
}

_MLP: Rules = {
    r"(^|\.)(gate|up)_proj\.weight$": ("mlp", "embed"),
    r"(^|\.)(gate|up)_proj\.bias$": ("mlp",),
    r"(^|\.)down_proj\.weight$": ("embed", "mlp"),
    r"(^|\.)down_proj\.bias$": ("embed",),
}

_LLAMA_LIKE: Rules = MappingProxyType({**_EMBEDDINGS, **_ATTENTION, **_MLP})

# Routed experts as transformers 5 stores them: one [E, 2 * I, H] gate|up tensor and one
# [E, H, I] down tensor per layer, and a router weight [E, H]. Replicated over tensor_parallel,
# like d9d's own MoE (d9d.moe): each rank routes the tokens it holds.
_ROUTED_EXPERTS: Rules = {
    r"(^|\.)experts\.gate_up_proj$": ("experts", "expert_mlp", "embed"),
    r"(^|\.)experts\.down_proj$": ("experts", "embed", "expert_mlp"),
    r"(^|\.)mlp\.gate\.weight$": ("experts", "embed"),
}

_MOE: Rules = MappingProxyType({**_ROUTED_EXPERTS, **_LLAMA_LIKE})

# Phi-3 fuses q|k|v into qkv_proj and gate|up into gate_up_proj. A Shard(0) of a fused weight
# over tp ranks cuts at row ranges, not at the q|k|v (or gate|up) boundaries: rank 0 would get
# every q row and rank 1 the k and v rows. Phi-3's attention also slices its qkv output at
# config.num_attention_heads * head_dim, a global count. So the fused weights stay whole on tp,
# and with them the projections that consume their outputs (o_proj, down_proj): tensor_parallel
# then runs Phi-3's blocks replicated, which needs sequence_parallel=False.
_PHI3: Rules = MappingProxyType(
    {
        **_EMBEDDINGS,
        r"(^|\.)qkv_proj\.weight$": ("embed", "embed"),
        r"(^|\.)o_proj\.weight$": ("embed", "embed"),
        r"(^|\.)gate_up_proj\.weight$": ("embed", "embed"),
        r"(^|\.)down_proj\.weight$": ("embed", "embed"),
    }
)

# GPT-2's Conv1D layers (c_attn fuses q|k|v) are transposed linears that tensor_parallel does
# not shard: whole on tp, so its blocks run replicated (sequence_parallel=False). The token
# embedding and the head tied to it are vocab-parallel; the learned positions (wpe) keep the
# nn.Embedding default, vocab-parallel over the positions.
_GPT2: Rules = MappingProxyType(
    {
        r"(^|\.)wte\.weight$": ("vocab", "embed"),
        r"(^|\.)c_(attn|proj|fc)\.weight$": ("embed", "embed"),
        r"(^|\.)c_(attn|proj|fc)\.bias$": ("embed",),
    }
)

FAMILIES: Mapping[str, Rules] = MappingProxyType(
    {
        "llama": _LLAMA_LIKE,
        "mistral": _LLAMA_LIKE,
        "qwen2": _LLAMA_LIKE,
        "qwen3": _LLAMA_LIKE,
        "gemma": _LLAMA_LIKE,
        "gemma2": _LLAMA_LIKE,
        "phi3": _PHI3,
        "gpt2": _GPT2,
        "qwen3_moe": _MOE,
        "mixtral": _MOE,
    }
)
"""``{model_type: {path regex: logical axes}}`` of every family d9d has rules for."""

# The sparse MoE blocks route each token on its own (top-k of its own router logits, no
# capacity, no jitter at the default router_jitter_noise=0.0), so tensor_parallel's sequence
# parallelism may run them, experts replicated, on each rank's part of the sequence. Their
# router logits, which transformers' own aux loss reads, then hold those positions only
# (tensor_parallel refuses output_router_logits under sequence parallelism).
POSITION_WISE: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "qwen3_moe": ("Qwen3MoeSparseMoeBlock",),
        "mixtral": ("MixtralSparseMoeBlock",),
    }
)
"""``{model_type: class names}`` of the modules of a family that compute each position on
its own (see ``d9d._structure.position_wise_paths``)."""
