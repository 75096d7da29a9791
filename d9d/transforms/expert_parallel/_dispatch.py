"""Dispatch and combine: rows grouped by expert sent to the ep rank that owns the expert, and
their outputs sent back, each an uneven all-to-all with exact autograd.

The experts module is called with ``(rows [N, dim] grouped by global expert, group_sizes
[E])``. With ``E`` experts over ``ep`` ranks, rank ``j`` owns experts ``j*L .. (j+1)*L - 1``
(``L = E / ep``), so the rows for rank ``j`` are one contiguous run. :func:`route_rows`
exchanges the per-expert counts (one all-to-all of ``E`` int32) and reads the split sizes on
the host; :func:`dispatch` sends the rows (rows arrive grouped by source rank, then by local
expert) and regroups them by local expert; :func:`combine` undoes both. Each all-to-all's
backward is the reverse all-to-all of the grads, so grads are exact.

Meta tensors (``d9d plan``'s dry run on simulated ranks) hold no routing: there the route is
the uniform one, each rank sending every rank an equal share of its rows (the first ranks one
more when they do not split evenly), which is the assumption ``d9d plan`` states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Route", "combine", "dispatch", "route_rows"]

# The functional collective ops (what ``d9d.core._comm_count`` counts, and what DTensor issues).
_c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class Route:
    """Where one experts call's rows go and come from on its ep group.

    Attributes:
        group_name: The ep axis' process group.
        send: Rows sent to each ep rank (this rank's rows for that rank's experts).
        recv: Rows received from each ep rank (its rows for this rank's experts).
        order: ``[sum(recv)]``: for each row grouped by local expert (then by source rank),
            its index among the rows as received (grouped by source rank, then local expert).
        local_sizes: ``[L]`` int32: rows per local expert, what the local experts' grouped
            GEMMs take as group sizes.
    """

    group_name: str
    send: list[int]
    recv: list[int]
    order: Tensor
    local_sizes: Tensor


def route_rows(group_sizes: Tensor, ranks: int, group_name: str, rows: int) -> Route:
    """The route of ``rows`` rows grouped by expert (``group_sizes [E]``) over ``ranks`` ep
    ranks.

    One all-to-all of the per-expert counts; the split sizes are then read on the host
    (one device-to-host copy: uneven all-to-alls take their sizes as Python ints).
    """
    with torch.no_grad():
        counts = group_sizes.to(torch.int32).contiguous()
        local = counts.numel() // ranks
        split = [local] * ranks
        received = _c10d.wait_tensor(_c10d.all_to_all_single(counts, split, split, group_name))
        if counts.is_meta:
            return _uniform(rows, ranks, local, group_name, counts)
        theirs = received.view(ranks, local).to(torch.int64)  # [source rank, local expert]
        sizes = torch.stack([counts.view(ranks, local).sum(1).to(torch.int64), theirs.sum(1)])
        send, recv = sizes.tolist()
        order = _by_local_expert(theirs, sum(recv))
        return Route(group_name, send, recv, order, theirs.sum(0).to(torch.int32))


def _uniform(rows: int, ranks: int, local: int, group_name: str, counts: Tensor) -> Route:
    """The route of uniform routing, on meta tensors (no values to read)."""
    send = [rows // ranks + (i < rows % ranks) for i in range(ranks)]
    order = torch.arange(rows, device=counts.device)
    return Route(group_name, send, list(send), order, counts.new_empty(local))


def _by_local_expert(counts: Tensor, total: int) -> Tensor:
    """For ``counts [source, expert]`` rows received source-major, the received index of each
    row in expert-major order."""
    starts = (counts.flatten().cumsum(0) - counts.flatten()).view_as(counts)
    runs, run_starts = counts.T.flatten(), starts.T.flatten()
    offsets = runs.cumsum(0) - runs
    within = torch.arange(total, device=counts.device)
    within = within - torch.repeat_interleave(offsets, runs, output_size=total)
    return torch.repeat_interleave(run_starts, runs, output_size=total) + within


def dispatch(rows: Tensor, route: Route) -> Tensor:
    """``rows [N, dim]`` (grouped by global expert) sent to their experts' ranks: this rank's
    received rows ``[sum(route.recv), dim]`` grouped by local expert."""
    received = _AllToAll.apply(rows, route.recv, route.send, route.group_name)
    return received.index_select(0, route.order)


def combine(outputs: Tensor, route: Route) -> Tensor:
    """The local experts' ``outputs`` (rows as :func:`dispatch` returned them) sent back:
    ``[N, dim]`` in the order of the rows dispatched."""
    inverse = torch.empty_like(route.order)
    inverse[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    return _AllToAll.apply(
        outputs.index_select(0, inverse), route.send, route.recv, route.group_name
    )


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
