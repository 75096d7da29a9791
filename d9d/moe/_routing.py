"""Top-k routing: scores, group-limited selection, weights, capacity; all on the device."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ._config import MoEConfig

__all__ = ["Routing", "route"]


class Routing(NamedTuple):
    """Where each token goes and with what weight."""

    expert_ids: Tensor  # [T, top_k] int64, distinct experts per token, best first
    weights: Tensor  # [T, top_k] float32 (or wider), 0 for a choice dropped over capacity
    scores: Tensor  # [T, E] float32 (or wider): softmax or sigmoid of the logits


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def route(logits: Tensor, config: MoEConfig, bias: Tensor | None = None) -> Routing:
    """The experts and weights of each token from its router ``logits`` ``[T, E]``.

    Scores are ``softmax`` or ``sigmoid`` of the logits, in float32 at least. Selection ranks
    ``scores + bias`` (the aux-loss-free bias changes which experts win, never the weights);
    with ``n_group > 1`` only experts of the ``topk_group`` best groups compete, a group
    scoring the sum of its two best experts (one, for groups of one), as in DeepSeek-V3.
    Weights are the selected scores, divided by their sum with ``norm_topk``, times
    ``routed_scaling_factor``. With a ``capacity_factor`` a choice past its expert's capacity
    (counting in token order) gets weight 0. No host sync.

    Example:
        >>> cfg = MoEConfig(dim=4, n_experts=3, top_k=1, expert_dim=4)
        >>> route(torch.tensor([[0.0, 2.0, 1.0]]), cfg).expert_ids
        tensor([[1]])
    """
    scores = logits.to(_wide(logits.dtype))
    scores = scores.softmax(-1) if config.score_func == "softmax" else scores.sigmoid()
    select = scores.detach() if bias is None else scores.detach() + bias.detach().to(scores.dtype)
    if config.n_group > 1:
        select = _limit_groups(select, config.n_group, config.topk_group)
    expert_ids = select.topk(config.top_k, dim=-1).indices
    weights = scores.gather(-1, expert_ids)
    if config.norm_topk:
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-20)
    weights = weights * config.routed_scaling_factor
    if config.capacity_factor is not None:
        weights = weights * _within_capacity(expert_ids, config)
    return Routing(expert_ids, weights, scores)


def _limit_groups(select: Tensor, n_group: int, topk_group: int) -> Tensor:
    """``select`` with the experts outside each token's best ``topk_group`` groups at -inf."""
    tokens, experts = select.shape
    grouped = select.view(tokens, n_group, experts // n_group)
    best = grouped.topk(min(2, experts // n_group), dim=-1).values.sum(-1)  # [T, n_group]
    keep = torch.zeros_like(best, dtype=torch.bool)
    keep.scatter_(-1, best.topk(topk_group, dim=-1).indices, True)
    return grouped.masked_fill(~keep[..., None], -math.inf).view(tokens, experts)


def _within_capacity(expert_ids: Tensor, config: MoEConfig) -> Tensor:
    """``[T, top_k]`` 1.0 where the choice is among its expert's first ``capacity`` (in the
    order of tokens, then choices), else 0.0."""
    tokens = expert_ids.shape[0]
    capacity = math.ceil(config.capacity_factor * tokens * config.top_k / config.n_experts)
    one_hot = torch.nn.functional.one_hot(expert_ids.reshape(-1), config.n_experts)
    before = one_hot.cumsum(0) - one_hot  # earlier choices of the same expert
    position = (before * one_hot).sum(-1).view_as(expert_ids)
    return (position < capacity).to(torch.float32)
