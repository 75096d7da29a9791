"""Hand-written logical-axis rules of Hugging Face models, where ``transformers``' plans lack them.

Each table maps path regexes (matched with ``re.search`` against param paths such as
``model.layers.0.self_attn.q_proj.weight``) to logical axis names, one per dim. A ``weight`` of
an ``nn.Linear`` is ``[out, in]``; a ``transformers`` ``Conv1D`` weight is ``[in, out]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["FAMILIES", "FILL", "POSITION_WISE", "ROUTERS"]

Rules = Mapping[str, tuple[str | None, ...]]

# Every family whose config carries a tensor-parallel plan (base_model_tp_plan) gets its rules
# from it (_tp_plan.py): Llama, Mistral, Qwen2/3, Gemma 1/2, Phi-3, Qwen3-MoE, Mixtral and the
# rest of the 116 causal-LM families of transformers 5.24 with a plan. Tables here only add
# what no plan says.

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

# Dory's plan names its embedding and head only. Its attention and its MLP each normalize
# the output of all their heads or channels before their last projection (attn_sub_norm,
# ffn_sub_norm: norms without a weight, which no rule can name): sharded, those norms'
# statistics would be the rank's shard's (the sweep found tp=2 rel 4e3 off), so both stay
# whole on tp, with their per-channel scales; its per-layer rates scale the residual stream.
_DORY: Rules = MappingProxyType(
    {
        r"(^|\.)(self_attn|mlp)\.\w+_proj\.weight$": ("embed", "embed"),
        r"(^|\.)self_attn\.(sqk|s_gate)$": ("embed",),
        r"(^|\.)mlp\.suv_(gate|up)$": ("embed",),
        r"(^|\.)layers\.\d+\.lambda_[12]$": ("embed",),
    }
)

FAMILIES: Mapping[str, Rules] = MappingProxyType({"gpt2": _GPT2, "dory": _DORY})
"""``{model_type: {path regex: logical axes}}`` of the families whose ``transformers`` plan is
missing (GPT-2: ``GPT2Config`` has none) or whose modules its Llama-layout names would shard
wrongly (Dory's attention), and d9d has rules for."""

ROUTERS: Rules = MappingProxyType(
    {
        r"(^|\.)(mlp|block_sparse_moe|feed_forward)\.(gate|router)(\.wg|\.gate)?\.weight$": (
            "experts",
            "embed",
        ),
        r"(^|\.)(mlp|block_sparse_moe)\.(gate|router)\.(bias|e_score_correction_bias)$": (
            "experts",
        ),
        r"(^|\.)mlp\.expert_bias$": ("experts",),  # AFMoE's routing bias, beside its router
        # Ernie-4.5-MoE's frozen routing bias [1, E], in a module of its own beside the router.
        r"(^|\.)mlp\.gate\.moe_statics\.e_score_correction_bias$": ("embed", "experts"),
    }
)
"""The MoE routers' weights ``[E, H]`` (``mlp.gate``, ``mlp.router``, Hunyuan's ``gate.wg``,
AFMoE's ``router.gate``, Llama-4's ``feed_forward.router``) and their biases, which no
``transformers`` tp plan names (they stay replicated there): ``experts`` keeps them whole on
tp, like d9d's own router."""

# Many plans name only part of the model (Hunyuan's names its embedding only, Granite-MoE's its
# experts only): a model that has a plan gets these, by the names of the Llama layout, for the
# params its plan leaves out. A family whose attention does not follow those names' meaning
# fails loudly (tensor_parallel's checks, or a shape error in transformers), never silently:
# the sweep (tests/hf/sweep.py) runs each family against one device.
FILL: Rules = MappingProxyType(
    {
        r"(^|\.)self_attn\.q_proj\.weight$": ("heads", "embed"),
        r"(^|\.)self_attn\.[kv]_proj\.weight$": ("kv_heads", "embed"),
        r"(^|\.)self_attn\.q_proj\.bias$": ("heads",),
        r"(^|\.)self_attn\.[kv]_proj\.bias$": ("kv_heads",),
        r"(^|\.)self_attn\.o_proj\.weight$": ("embed", "heads"),
        r"(^|\.)self_attn\.o_proj\.bias$": ("embed",),
        r"(^|\.)self_attn\.out_proj\.weight$": ("embed", "heads"),  # LFM2's o_proj
        r"(^|\.)mlp\.(gate|up)_proj\.weight$": ("mlp", "embed"),
        r"(^|\.)mlp\.(gate|up)_proj\.bias$": ("mlp",),
        r"(^|\.)mlp\.down_proj\.weight$": ("embed", "mlp"),
        r"(^|\.)mlp\.down_proj\.bias$": ("embed",),
        # The MLP under the name feed_forward (Jamba's, Falcon-H1's; LFM's w1/w3 up, w2 down).
        r"(^|\.)feed_forward\.(gate_proj|up_proj|w1|w3)\.weight$": ("mlp", "embed"),
        r"(^|\.)feed_forward\.(down_proj|w2)\.weight$": ("embed", "mlp"),
        # Per-head norms of q and k (Hunyuan's query_layernorm): each rank normalizes its own
        # heads, so their grads are summed over tp. Norms over all heads (Olmo2's) are the
        # plan's, which keeps their projections whole (plan_rules).
        r"(^|\.)self_attn\.(q|k|query|key)_(norm|layernorm)\.weight$": ("head_dim",),
        # Attention sinks, one logit per head (GPT-OSS's, whose plan names the embedding only):
        # each rank's attention adds its heads' (plans that name them say colwise).
        r"(^|\.)self_attn\.sinks$": ("heads",),
        # Latent attention's down-projections and their norms (DeepSeek-V2/V3's q_a_proj, which
        # no plan names): replicated, read by the rank's heads only, so their grads are summed.
        r"(^|\.)self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$": ("latent", "embed"),
        r"(^|\.)self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.bias$": ("latent",),
        r"(^|\.)self_attn\.(q_a|kv_a)_layernorm\.weight$": ("latent",),
        r"(^|\.)self_attn\.(q_b_proj|kv_b_proj)\.weight$": ("heads", "latent"),
        # Shared experts of an MoE layer (Qwen2-MoE's shared_expert, ...): a dense MLP.
        r"(^|\.)mlp\.shared_(experts?|mlp)\.(gate|up)_proj\.weight$": ("mlp", "embed"),
        r"(^|\.)mlp\.shared_(experts?|mlp)\.down_proj\.weight$": ("embed", "mlp"),
        # xIELU's scalars (Apertus): they scale the rank's shard of the mlp, so their grads are
        # summed over tp in both modes (mlp_scale); whole and unsummed they were 0.49 off
        # without sequence parallelism.
        r"(^|\.)mlp\.act_fn\.alpha_[pn]$": ("mlp_scale",),
        # Attention output gates, one per head channel (AFMoE's, Beam's colwise in its plan).
        r"(^|\.)self_attn\.gate_proj\.weight$": ("heads", "embed"),
        # HRM's frozen initial state of its low cycle [H], beside its blocks: whole on tp.
        r"(^|\.)z_L_init$": ("embed",),
        # The output head a plan leaves out (NemotronH's names its embedding only).
        r"^lm_head\.weight$": ("vocab", "embed"),
        # Qwen2-MoE's shared expert gate [1, H]: whole on tp, beside the router.
        r"(^|\.)mlp\.shared_expert_gate\.weight$": ("experts", "embed"),
    }
)
"""Llama-layout rules for what a model's tp plan leaves out (used only where it has a plan)."""

# The sparse MoE blocks route each token on its own (top-k of its own router logits, no
# capacity, no jitter at the default router_jitter_noise=0.0), so tensor_parallel's sequence
# parallelism may run them, experts replicated, on each rank's part of the sequence. Their
# router logits, which transformers' own aux loss reads, then hold those positions only
# (tensor_parallel refuses output_router_logits under sequence parallelism). A family is listed
# only once its tp=2 sweep cell (tests/hf/sweep.py) equals one device with sequence parallelism:
# the class name alone does not prove a block drops no token.
POSITION_WISE: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "qwen3_moe": ("Qwen3MoeSparseMoeBlock",),
        "mixtral": ("MixtralSparseMoeBlock",),
        "afmoe": ("AfmoeSparseMoeBlock",),
        "aria_text": ("AriaTextMoELayer",),
        "axk1": ("AXK1MoE",),
        # AXK2's gated norms too: an RMSNorm times a per-token low-rank sigmoid gate (an MLP
        # that no plan names, kept whole), which sequence parallelism runs on the rank's part.
        "axk2": ("AXK2MoE", "AXK2GatedRMSNorm"),
        "deepseek_v2": ("DeepseekV2Moe",),
        "dots1": ("Dots1MoE",),
        "dots3_note_text": ("Dots3NoteTextMoE",),
        "exaone_moe": ("ExaoneMoeSparseMoEBlock",),
        "glm4_moe": ("Glm4MoeMoE",),
        "glm4_moe_lite": ("Glm4MoeLiteMoE",),
        "gpt_oss": ("GptOssMLP",),
        "granitemoe": ("GraniteMoeMoE",),
        "granitemoe_swa": ("GraniteMoeSWAMoE",),
        "hy_v3": ("HYV3MoE",),
        "hunyuan_v1_moe": ("HunYuanMoEV1Moe",),
        "kolibri1": ("Kolibri1SparseMoeBlock",),
        "laguna": ("LagunaSparseMoeBlock",),
        "llama4_text": ("Llama4TextMoe",),
        "qwen2_moe": ("Qwen2MoeSparseMoeBlock",),
        "sarvam_mla": ("DeepseekV3MoE",),
        "sarvam_moe": ("Glm4MoeMoE",),
        "solar_open": ("SolarOpenMoE",),
        "ernie4_5_moe": ("Ernie4_5_MoeSparseMoeBlock",),
        # Qwen2-MoE's block (router, experts, gated shared expert) beside a gated delta net or
        # a kimi delta attention that d9d keeps whole (_kept_whole.py), so that these families
        # run without sequence parallelism: equal to one device there (their sweep cells).
        "kimi_linear": ("KimiLinearMoE",),
        "lara_mini": ("LaraMiniSparseMoeBlock",),
        "qwen3_5_moe_text": ("Qwen3_5MoeSparseMoeBlock",),
        "qwen3_next": ("Qwen3NextSparseMoeBlock",),
        "qwen4_exp_text": ("Qwen4ExpTextSparseMoeBlock",),
        # HY-V4's block (router, experts, shared experts) beside hyper-connections kept whole
        # (no sharded linear: sequence parallelism refused there): equal without it.
        "hy_v4": ("HYV4MoE",),
    }
)
"""``{model_type: class names}`` of the modules of a family that compute each position on
its own (see ``d9d.core._structure.position_wise_paths``)."""
