"""The ``c10d`` backend of ``dispatch``/``combine``: uneven ``all_to_all_single`` (gloo, NCCL).

Dispatch makes one all-to-all of counts (per destination rank: the tokens sent there and
the rank's choices of each of its experts, ``R * (L + 1)`` int64) and reads the split sizes
on the host, then sends each token once to every rank owning one of its experts, with its
top-k ids (int32) and weights. Combine sends back one row per received token: the weighted
sum of its local experts' outputs, which the source sums over ranks. A rank's tokens for
itself never enter the all-to-alls (an empty split there): every byte the collectives count
leaves the rank. Each transfer's backward is the reverse transfer, so grads are exact.

Meta tensors (``d9d plan``'s dry runs on simulated ranks) hold no routing: there the sizes
are those of :func:`uniform_split`, the stated assumption of the plan.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from ._moe_dispatch_layout import (
    DispatchGroup,
    DispatchHandle,
    DispatchLayout,
    by_local_expert,
    weighted_sums,
)

__all__ = ["combine_c10d", "dispatch_c10d", "uniform_split"]

_c10d = torch.ops._c10d_functional


def uniform_split(tokens: int, num_experts: int, top_k: int, ranks: int) -> tuple[int, list[int]]:
    """``(tokens sent to each rank, choices of each expert)`` of ``tokens`` tokens whose
    ``top_k`` experts are drawn uniformly without replacement from ``num_experts``.

    A token reaches a rank (``L = E / R`` experts) unless all its experts are elsewhere:
    ``T * (1 - C(E - L, k) / C(E, k))`` tokens per rank, rounded half up; the ``T * k``
    choices split evenly over the experts, the first ones one more where they do not divide.

    Example:
        >>> uniform_split(64, 6, 2, 2)  # 64 * (1 - 3/15) = 51.2
        (51, [22, 22, 21, 21, 21, 21])
    """
    local = num_experts // ranks
    missed = Fraction(math.comb(num_experts - local, top_k), math.comb(num_experts, top_k))
    per_rank = math.floor(tokens * (1 - missed) + Fraction(1, 2))
    choices = tokens * top_k
    base, extra = divmod(choices, num_experts)
    return per_rank, [base + (e < extra) for e in range(num_experts)]


def dispatch_c10d(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, layout: DispatchLayout, group: DispatchGroup
) -> tuple[Tensor, Tensor, DispatchHandle]:
    ranks, me, name = group.size, group.rank, group.name
    local = layout.tokens_per_expert.numel() // ranks
    send, recv, rows = split_sizes(layout, topk_ids.shape[1], ranks, me, name)
    # Tokens to send, by destination rank, then token: the true entries of token_in_rank.T.
    absent = (~layout.token_in_rank.T).flatten().to(torch.int8)
    send_token = torch.argsort(absent, stable=True)[: sum(send)] % x.shape[0]
    received = [
        exchange(t.index_select(0, send_token), send, recv, me, name)
        for t in (x, topk_ids.to(torch.int32), topk_weights)
    ]
    out, sizes, row_token, row_weights = by_local_expert(*received, me * local, local, rows)
    route = (send_token, send, recv)
    handle = DispatchHandle("c10d", group, x.shape[0], sum(recv), row_token, row_weights, route)
    return out, sizes, handle


def combine_c10d(outputs: Tensor, handle: DispatchHandle) -> Tensor:
    send_token, send, recv = handle.route
    group = handle.group
    back = exchange(weighted_sums(outputs, handle), recv, send, group.rank, group.name)
    wide = torch.promote_types(outputs.dtype, torch.float32)
    out = outputs.new_zeros(handle.tokens, outputs.shape[1], dtype=wide)
    return out.index_add(0, send_token, back.to(wide)).to(outputs.dtype)


def split_sizes(
    layout: DispatchLayout, top_k: int, ranks: int, me: int, group_name: str
) -> tuple[list[int], list[int], int]:
    """``(tokens sent to each rank, tokens received from each, rows for the local experts)``:
    one all-to-all of the counts and one host read (uneven all-to-alls take Python ints)."""
    local = layout.tokens_per_expert.numel() // ranks
    with torch.no_grad():
        counts = torch.cat(
            [layout.tokens_per_rank.view(ranks, 1), layout.tokens_per_expert.view(ranks, local)],
            dim=1,
        ).flatten()
        split = [local + 1] * ranks
        theirs = _c10d.wait_tensor(_c10d.all_to_all_single(counts, split, split, group_name))
        if counts.is_meta:
            tokens = layout.token_in_rank.shape[0]
            per_rank, choices = uniform_split(tokens, local * ranks, top_k, ranks)
            rows = ranks * sum(choices[me * local : (me + 1) * local])
            return [per_rank] * ranks, [per_rank] * ranks, rows
        theirs = theirs.view(ranks, local + 1)
        sizes = torch.cat([layout.tokens_per_rank, theirs[:, 0], theirs[:, 1:].sum().view(1)])
        values = sizes.tolist()
    return values[:ranks], values[ranks : 2 * ranks], values[-1]


def exchange(rows: Tensor, send: list[int], recv: list[int], me: int, group_name: str) -> Tensor:
    """``rows`` grouped by destination rank (``send[j]`` for rank ``j``) to the rows received,
    grouped by source rank (``recv[j]`` from rank ``j``); this rank's own rows stay here."""
    before, own, after = rows.split([sum(send[:me]), send[me], sum(send[me + 1 :])])
    off_send, off_recv = [*send[:me], 0, *send[me + 1 :]], [*recv[:me], 0, *recv[me + 1 :]]
    moved = _AllToAll.apply(torch.cat([before, after]), off_recv, off_send, group_name)
    first, rest = moved.split([sum(recv[:me]), sum(recv[me + 1 :])])
    return torch.cat([first, own, rest])


class _AllToAll(torch.autograd.Function):
    """An uneven all-to-all of rows; its backward sends the grads back the same way."""

    @staticmethod
    def forward(
        ctx: Any, rows: Tensor, out_splits: list[int], in_splits: list[int], group: str
    ) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(rows: Tensor, out_splits: list[int], in_splits: list[int], group: str) -> Tensor:
    sent = _c10d.all_to_all_single(rows.contiguous(), out_splits, in_splits, group)
    return _c10d.wait_tensor(sent)
