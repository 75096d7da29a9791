"""The activation memory one rank keeps from the forward for the backward: an analytic
estimate for :class:`d9d.models.Llama`, checked against measured bytes by
tests/cli/test_plan_command.py (the formula and its terms: docs/plan.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..models import LlamaConfig

__all__ = ["ActivationLayout", "activation_bytes", "in_flight"]


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


def activation_bytes(config: LlamaConfig, layout: ActivationLayout) -> int:
    """Bytes of the tensors a float32 forward keeps alive for its backward on one rank.

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
        Bytes, an int.

    Example:
        >>> activation_bytes(LlamaConfig.small(), ActivationLayout(batch=4, seq=256)) // 2**20
        83
    """
    t, c, a = layout.tp, layout.cp, layout.item
    d, f, heads, vocab = config.dim, config.ffn_dim, config.n_heads, config.vocab_size
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
    kept = blocks * per_token * tokens * a
    # RoPE's cosines and sines of the rank's positions, kept by every block's rotation.
    kept += 2 * (layout.seq // c) * config.head_dim * a
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
    return int(kept * layout.microbatches)


def in_flight(schedule: str, microbatches: int, stages: int, stage: int) -> int:
    """Microbatches whose activations pipeline stage ``stage`` of ``stages`` holds at its
    peak: all of them under GPipe, ``stages - stage`` under 1F1B (its warm-up), which the
    interleaved and zero-bubble schedules are taken to match (not measured)."""
    if schedule == "gpipe":
        return microbatches
    return min(microbatches, stages - stage)
