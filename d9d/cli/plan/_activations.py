"""The activation memory one rank keeps from the forward for the backward: an analytic
estimate for :class:`d9d.models.Llama` and :class:`d9d.models.MoE`, checked against measured
bytes by tests/cli/test_plan_activations.py (the formula and its terms: docs/plan.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ...models import LlamaConfig, MoEConfig
from ...moe import MoEConfig as LayerConfig

__all__ = ["ActivationLayout", "activation_bytes", "in_flight", "moe_activation_bytes"]


@dataclass(frozen=True)
class ActivationLayout:
    """What one rank runs: ``batch`` sequences of ``seq`` tokens per microbatch, split over
    ``tp`` and ``cp``, ``blocks`` blocks of the model (a pipeline stage's), with or without
    the embedding (``first``) and the head and loss (``last``), ``microbatches`` of them alive
    at once, under ``remat`` (``"none"``, ``"selective"`` or ``"full"``)."""

    batch: int
    seq: int
    tp: int = 1
    cp: int = 1
    blocks: int | None = None
    first: bool = True
    last: bool = True
    microbatches: int = 1
    remat: str = "none"
    item: int = 4


def activation_bytes(config: LlamaConfig, layout: ActivationLayout) -> int | None:
    """Bytes of the tensors a float32 forward keeps alive for its backward on one rank, or
    None for a layout the formula does not cover (selective remat under ``cp``: the dry run
    on meta measured 10-14% more than it gives, see docs/plan.md).

    Per block and token of the rank's sequence chunk (``T = batch * seq / cp`` tokens),
    with ``d`` the width, ``f`` the MLP width, ``k`` the kv width, ``H`` the heads and
    ``t = tp``: no remat keeps ``8d + 2k + 4f + H + 2`` elements (``d`` more under ``cp``);
    under ``tp`` (sequence parallel) ``2d + (6d + 2k + 4f + H + 2) / t``; ``"selective"``
    ``(5d + 2k + 2f + H) / t`` (``+ 2d`` of reduce-scatter outputs under ``tp``);
    ``"full"`` the block input ``d / t``. Outside the blocks: the embedding output, the final
    norm, the logits (twice under ``tp``: loss parallelism keeps its shard and its
    exponentials) and the per-token loss terms.

    Args:
        config: The model's shapes.
        layout: What the rank runs.

    Returns:
        Bytes, an int, or None.

    Example:
        >>> activation_bytes(LlamaConfig.small(), ActivationLayout(batch=4, seq=256)) // 2**20
        83
    """
    t, c, a = layout.tp, layout.cp, layout.item
    if c > 1 and layout.remat == "selective":
        return None
    d, f, heads = config.dim, config.ffn_dim, config.n_heads
    k = config.n_kv_heads * config.head_dim
    tokens = layout.batch * layout.seq // c
    match layout.remat:
        case "none":
            sharded = 6 * d + 2 * k + 4 * f + heads + 2 + (d if c > 1 else 0)
            per_token = 2 * d + sharded / t
        case "selective":
            per_token = (5 * d + 2 * k + 2 * f + heads) / t + (2 * d if t > 1 else 0)
        case "full":
            per_token = d / t
        case _:
            raise ValueError(f"--remat must be none, selective or full, got {layout.remat!r}")
    blocks = config.n_layers if layout.blocks is None else layout.blocks
    kept = blocks * per_token * tokens * a + _outside_blocks(config, layout, config.head_dim)
    return int(kept * layout.microbatches)


def _outside_blocks(config: LlamaConfig | MoEConfig, layout: ActivationLayout, head: int) -> float:
    """Bytes kept outside the blocks: RoPE's tables, the embedding's output, the final norm,
    the logits and the loss's terms."""
    t, c, a = layout.tp, layout.cp, layout.item
    d, vocab = config.dim, config.vocab_size
    tokens = layout.batch * layout.seq // c
    # RoPE's cosines and sines of the rank's positions, kept by every block's rotation.
    kept = 2 * (layout.seq // c) * head * a
    if c > 1:
        kept += 8 * (layout.seq // c)  # the rank's positions (int64)
    if layout.first:
        kept += tokens * d / t * a  # the embedding's output, the first block's input
    if layout.last:
        if t > 1:  # normed and rsqrt on the sequence shard, the gathered output; two logits
            floats = (d + 1 + 2 * vocab) / t + d + 1
            small = 2 * 8 + 4  # labels and their vocab-shard index (int64), 4 masks
        else:  # normed, rsqrt and output of the final norm; logits; log-sum-exp
            floats = 2 * d + vocab + 2
            small = 8 + 2  # labels (int64), 2 masks
        kept += tokens * (floats * a + small) + 12  # and the loss's two 0-d tensors
    return kept


def _moe_layer_bytes(layer: LayerConfig, item: int) -> tuple[float, float]:
    """``(bytes per token, bytes per block)`` an MoE layer keeps, its input norm included.

    Per token: the norm's input and output (``2d``) and, per chosen expert, its permuted row,
    the down projection's output (``2d``) and the gate, up, SwiGLU and SiLU rows (``4I``), in
    the activations' dtype; the shared experts' four rows (``4s``); in float32 or int64, the
    router's logits (``E``), the norm's rsqrt, 7 words per choice (ids, row map, weights,
    scores) and 6 more, ``E + 1`` for the z-loss, ``2k`` for renormalized weights and ``k``
    for the capacity mask. Per block: the global load and its count (``8E + 4``), and
    ``4E + 4`` for the balance loss.
    """
    d, experts, k, width = layer.dim, layer.n_experts, layer.top_k, layer.expert_dim
    wide = 2 * d + k * (2 * d + 4 * width) + 4 * layer.shared_dim
    words = 1 + experts + 7 * k + 6
    words += (experts + 1 if layer.z_loss_coef else 0) + (2 * k if layer.norm_topk else 0)
    words += k if layer.capacity_factor is not None else 0
    per_block = 8 * experts + 4 + (4 * experts + 4 if layer.aux_loss_coef else 0)
    return wide * item + 4 * words, per_block + (4 if layer.z_loss_coef else 0)


def moe_activation_bytes(config: MoEConfig, layout: ActivationLayout) -> int | None:
    """Bytes a forward of the :class:`d9d.models.MoE` decoder keeps for its backward on one
    rank, or None for a layout the formula does not cover (``tp``, ``cp`` or selective remat).
    The dense blocks are the first ones, rank 0's (the first pipeline stage holds them).

    Per block and token, no remat: attention ``4d + 2q + 2kv + H + 1`` elements (``q`` and
    ``kv`` the query and key/value widths; with ``qk_norm`` ``2q + 2kv + H + KV`` more, ``2q +
    2kv + 2`` for ``qk_norm="full"``), then
    a dense MLP ``2d + 1 + 4f`` or an MoE layer (:func:`_moe_layer_bytes`); ``"full"`` keeps
    each block's input ``d``. Outside the blocks as for :func:`activation_bytes`.

    Example:
        >>> moe_activation_bytes(MoEConfig.tiny(), ActivationLayout(batch=2, seq=64)) // 2**10
        1554
    """
    if layout.tp > 1 or layout.cp > 1 or layout.remat not in ("none", "full"):
        return None
    a, d, heads = layout.item, config.dim, config.n_heads
    q, kv = heads * config.attention_head_dim, config.n_kv_heads * config.attention_head_dim
    tokens = layout.batch * layout.seq
    blocks = config.n_layers if layout.blocks is None else layout.blocks
    dense = min(config.n_dense_layers, blocks)
    if layout.remat == "full":
        kept = blocks * d * a * tokens
    else:
        attention = 4 * d + 2 * q + 2 * kv + heads + 1
        if config.qk_norm:  # a norm's rsqrt per head, or per token for "full"
            per_row = 2 if config.qk_norm == "full" else heads + config.n_kv_heads
            attention += 2 * q + 2 * kv + per_row
        per_token, per_block = _moe_layer_bytes(config.moe, a)
        kept = (blocks * attention + dense * (2 * d + 1 + 4 * config.ffn_dim)) * a * tokens
        kept += (blocks - dense) * (per_token * tokens + per_block)
    kept += _outside_blocks(config, layout, config.attention_head_dim)
    return int(kept * layout.microbatches)


def in_flight(schedule: str, microbatches: int, stages: int, stage: int) -> int:
    """Microbatches whose activations pipeline stage ``stage`` of ``stages`` holds at its
    peak: all of them under GPipe, ``stages - stage`` under 1F1B (its warm-up), which the
    interleaved and zero-bubble schedules are taken to match (not measured)."""
    if schedule == "gpipe":
        return microbatches
    return min(microbatches, stages - stage)
