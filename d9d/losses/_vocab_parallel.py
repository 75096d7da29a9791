"""Log-sum-exp and target logit of vocab-sharded logits, without gathering the logits."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = ["is_vocab_sharded", "sharded_lse_and_target"]


def is_vocab_sharded(logits: torch.Tensor) -> bool:
    """Whether ``logits`` is a DTensor sharded over its last dim (and replicated otherwise)."""
    if not isinstance(logits, DTensor):
        return False
    shards = [p for p in logits.placements if isinstance(p, Shard)]
    return (
        len(shards) == 1
        and shards[0].dim in (-1, logits.ndim - 1)
        and all(isinstance(p, Replicate | Shard) for p in logits.placements)
    )


def sharded_lse_and_target(
    logits: DTensor, labels: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logsumexp(logits), logits[label])`` per token as plain tensors, from the local vocab
    shard and three all-reduces of one value per token (max, sum of exponentials, target).

    ``labels`` must be valid class ids (ignored tokens replaced by any valid id).
    """
    mesh = logits.device_mesh
    axis = next(i for i, p in enumerate(logits.placements) if isinstance(p, Shard))
    local = logits.to_local().to(dtype)
    vocab, ranks = logits.shape[-1], mesh.size(axis)
    chunk = -(-vocab // ranks)
    first = min(mesh.get_local_rank(axis) * chunk, vocab)
    replicate = [Replicate()] * mesh.ndim

    def total(value: torch.Tensor, op: str) -> torch.Tensor:
        placements = [Partial(op) if i == axis else Replicate() for i in range(mesh.ndim)]
        partial = DTensor.from_local(value, mesh, placements, run_check=False)
        return partial.redistribute(mesh, replicate).to_local()

    peak = total(local.detach().amax(-1), "max")
    lse = total((local - peak.unsqueeze(-1)).exp().sum(-1), "sum").log() + peak
    index = labels - first
    mine = (index >= 0) & (index < local.shape[-1])
    picked = local.gather(-1, index.clamp(0, max(local.shape[-1] - 1, 0)).unsqueeze(-1))
    target = total(torch.where(mine, picked.squeeze(-1), torch.zeros_like(lse)), "sum")
    return lse, target
