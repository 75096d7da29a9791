"""The ``reference`` backend of ``dispatch``/``combine``, the oracle of the others: no
all-to-all. Every rank all-gathers every rank's tokens, ids and weights (padded to the
longest rank's count) and keeps the choices of its own experts; combine sums each rank's
weighted outputs into a buffer of every rank's tokens and reduce-scatters it. In the
backward the gather's grads are reduce-scattered and the scatter's gathered. Every
token travels to every rank: it is for tests.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ._moe_dispatch_layout import (
    DispatchGroup,
    DispatchHandle,
    DispatchLayout,
    by_local_expert,
    weighted_sums,
)

__all__ = ["combine_reference", "dispatch_reference"]

_c10d = torch.ops._c10d_functional


def dispatch_reference(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, layout: DispatchLayout, group: DispatchGroup
) -> tuple[Tensor, Tensor, DispatchHandle]:
    ranks, me, name = group.size, group.rank, group.name
    local = layout.tokens_per_expert.numel() // ranks
    count = torch.tensor([x.shape[0]], device=x.device)
    longest = int(_gather(count, ranks, name).max())
    pad = longest - x.shape[0]
    ids = _gather(F.pad(topk_ids.long(), (0, 0, 0, pad), value=-1), ranks, name)  # -1: no expert
    rows = int(((ids // local) == me).sum())
    tokens, weights = (
        _AllGather.apply(F.pad(t, (0, 0, 0, pad)), ranks, name) for t in (x, topk_weights)
    )
    out, sizes, row_token, row_weights = by_local_expert(
        tokens, ids, weights, me * local, local, rows
    )
    handle = DispatchHandle(
        "reference", group, x.shape[0], ranks * longest, row_token, row_weights, longest
    )
    return out, sizes, handle


def combine_reference(outputs: Tensor, handle: DispatchHandle) -> Tensor:
    group = handle.group
    mine = _ReduceScatter.apply(weighted_sums(outputs, handle), group.size, group.name)
    return mine[: handle.tokens]


def _gather(t: Tensor, ranks: int, group: str) -> Tensor:
    return _c10d.wait_tensor(_c10d.all_gather_into_tensor(t.contiguous(), ranks, group))


def _scatter_sum(t: Tensor, ranks: int, group: str) -> Tensor:
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(t.contiguous(), "sum", ranks, group))


class _AllGather(torch.autograd.Function):
    """Every rank's rows, rank by rank; the backward sums each rank's grads over the ranks."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, ranks: int, group: str) -> Tensor:
        ctx.ranks, ctx.group = ranks, group
        return _gather(t, ranks, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _scatter_sum(grad, ctx.ranks, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    """The sum over the ranks of this rank's block of rows; the backward gathers the grads."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, ranks: int, group: str) -> Tensor:
        ctx.ranks, ctx.group = ranks, group
        return _scatter_sum(t, ranks, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather(grad, ctx.ranks, ctx.group), None, None
