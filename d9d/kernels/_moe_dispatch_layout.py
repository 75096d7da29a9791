"""What expert-parallel dispatch and combine share across backends: the layout of the top-k
ids (DeepEP's ``get_dispatch_layout``), the handle dispatch returns, and the two local steps
around the transfers: the received tokens expanded into rows grouped by local expert, and
the rows' weighted outputs summed back per received token.

Ranks of the ep group own contiguous runs of experts: with ``E`` experts over ``R`` ranks,
rank ``j`` owns experts ``j*L .. (j+1)*L - 1`` (``L = E / R``). A token travels once to each
rank that owns at least one of its experts, whatever the number of its experts there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from ..errors import KernelInputError

__all__ = [
    "DispatchGroup",
    "DispatchHandle",
    "DispatchLayout",
    "by_local_expert",
    "dispatch_layout",
    "weighted_sums",
]


class DispatchGroup(NamedTuple):
    """The ep process group as dispatch and combine use it: its name, this rank's index and
    its size, read from the group once. Traced code holds these, never the group object:
    torch 2.11's Dynamo cannot call the methods of the test runner's thread-rank group.

    Example:
        >>> DispatchGroup("ep", 0, 2).size
        2
    """

    name: str  # the group's name, which the functional collectives take
    rank: int  # this rank's index in the group
    size: int  # the group's ranks

    @classmethod
    def of(cls, group: ProcessGroup | DispatchGroup) -> DispatchGroup:
        """``group`` as a :class:`DispatchGroup` (itself if it is one)."""
        if isinstance(group, DispatchGroup):
            return group
        return cls(group.group_name, group.rank(), group.size())


class DispatchLayout(NamedTuple):
    """Where one rank's tokens go, from their top-k ids; computed locally, no communication."""

    token_in_rank: Tensor  # [T, R] bool: the token has at least one of its experts on rank r
    tokens_per_rank: Tensor  # [R] int64: tokens sent to each rank, once per rank
    tokens_per_expert: Tensor  # [E] int64: the rank's choices of each expert


def dispatch_layout(topk_ids: Tensor, num_experts: int, ranks: int) -> DispatchLayout:
    """The :class:`DispatchLayout` of ``topk_ids [T, k]`` for ``num_experts`` experts over
    ``ranks`` ep ranks (rank ``j`` owning experts ``j*E/R .. (j+1)*E/R - 1``).

    Example:
        >>> import d9d.kernels as K
        >>> layout = K.dispatch_layout(torch.tensor([[0, 1], [3, 0]]), 4, 2)
        >>> layout.tokens_per_rank.tolist(), layout.tokens_per_expert.tolist()
        ([2, 1], [2, 1, 0, 1])
    """
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(
            f"dispatch_layout: topk_ids must be an int32 or int64 tensor [T, top_k], got "
            f"{topk_ids.shape=}, {topk_ids.dtype=}"
        )
    if not isinstance(ranks, int) or ranks < 1 or num_experts % ranks:
        raise KernelInputError(
            f"dispatch_layout: {num_experts=} experts must split evenly over {ranks=} ranks"
        )
    ids = topk_ids.long()
    owner = ids // (num_experts // ranks)
    in_rank = torch.zeros(ids.shape[0], ranks, dtype=torch.bool, device=ids.device)
    in_rank.scatter_(1, owner, True)
    per_expert = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    per_expert.scatter_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
    return DispatchLayout(in_rank, in_rank.sum(0), per_expert)


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """What :func:`combine` needs of one :func:`dispatch`.

    Attributes:
        backend: The backend that dispatched; combine runs the same.
        group: The ep group.
        tokens: ``T``, the tokens of this rank dispatched (the rows combine returns).
        received: ``N``, the tokens this rank received (its own included).
        row_token: ``[M]`` int64: for each dispatched row (grouped by local expert), its
            received token.
        row_weights: ``[M]``: each row's routing weight (differentiable).
        route: The backend's record of how the received tokens came (to send them back).
    """

    backend: str
    group: DispatchGroup
    tokens: int
    received: int
    row_token: Tensor
    row_weights: Tensor
    route: Any


def by_local_expert(
    tokens: Tensor, ids: Tensor, weights: Tensor, first: int, local: int, rows: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Received ``tokens [N, dim]`` with their top-k ``ids`` and ``weights`` ``[N, k]``
    expanded into one row per choice of a local expert (``first .. first + local - 1``),
    grouped by local expert, then by received token, then by choice: ``(rows [M, dim],
    group_sizes [local] int32, row_token [M], row_weights [M])``; ``rows``: ``M``, known to
    the caller (a host read it has made already)."""
    k = ids.shape[1]
    local_ids = ids.long() - first
    mine = (local_ids >= 0) & (local_ids < local)
    key = torch.where(mine, local_ids, local).flatten()  # `local`: not this rank's
    order = torch.argsort(key, stable=True)[:rows]
    sizes = torch.zeros(local + 1, dtype=torch.int32, device=ids.device)
    sizes.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    row_token = order // k
    return (
        tokens.index_select(0, row_token),
        sizes[:local],
        row_token,
        weights.flatten().index_select(0, order),
    )


def weighted_sums(outputs: Tensor, handle: DispatchHandle) -> Tensor:
    """The rows' ``outputs [M, dim]`` times their routing weights, summed per received token
    in float32 (or wider) and cast once: ``[N, dim]`` of ``outputs``' dtype."""
    wide = torch.promote_types(outputs.dtype, torch.float32)
    weighted = outputs.to(wide) * handle.row_weights.to(wide)[:, None]
    sums = outputs.new_zeros(handle.received, outputs.shape[1], dtype=wide)
    return sums.index_add(0, handle.row_token, weighted).to(outputs.dtype)
