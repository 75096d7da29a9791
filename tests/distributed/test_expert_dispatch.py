"""Expert parallelism's dispatch and combine (``d9d/transforms/expert_parallel/_dispatch.py``)
against every expert run locally: outputs, input grads and the owners' expert grads, float64,
uneven routing with empty experts and a rank that sends nothing; the all-to-all bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import d9d
from d9d.core._comm_count import CollectiveCounter
from d9d.testing import run_on_ranks
from d9d.transforms import CommStats
from d9d.transforms.expert_parallel._dispatch import combine, dispatch, route_rows

DIM = 5


def _sizes(rank: int, experts: int) -> torch.Tensor:
    """Rows per expert on ``rank``: experts 1 and 4 get none anywhere, rank 1 sends none."""
    g = torch.Generator().manual_seed(rank)
    sizes = torch.randint(0, 4, (experts,), generator=g, dtype=torch.int32)
    sizes[[1, 4]] = 0
    return sizes * (rank != 1)


def _weights(experts: int) -> torch.Tensor:
    return torch.randn(experts, DIM, DIM, generator=torch.Generator().manual_seed(9)).double()


def _experts(rows: torch.Tensor, sizes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each expert's rows times its weight, one expert at a time (the reference)."""
    outs = [part @ w for part, w in zip(rows.split(sizes.tolist()), weights, strict=True)]
    return torch.cat(outs) if outs else rows.new_zeros(0, DIM)


def _rank(ranks: int, experts: int) -> tuple[list[torch.Tensor], list[torch.Tensor], CommStats]:
    mesh = d9d.make_mesh("cpu", ep=ranks)
    rank, local = dist.get_rank(), experts // ranks
    sizes = _sizes(rank, experts)
    g = torch.Generator().manual_seed(100 + rank)
    rows = torch.randn(int(sizes.sum()), DIM, generator=g).double()
    out_grad = torch.randn(rows.shape, generator=g).double()
    weights = _weights(experts)

    want_rows = rows.clone().requires_grad_()
    want_weights = weights.clone().requires_grad_()
    want = _experts(want_rows, sizes, want_weights)
    want.backward(out_grad)
    total = want_weights.grad.clone()
    dist.all_reduce(total)  # every rank's contribution to each expert

    mine = weights[rank * local : (rank + 1) * local].clone().requires_grad_()
    got_rows = rows.clone().requires_grad_()
    with CollectiveCounter(mesh) as counter:
        route = route_rows(sizes, ranks, mesh.get_group("ep").group_name, rows.shape[0])
        received = dispatch(got_rows, route)
        got = combine(_experts(received, route.local_sizes, mine), route)
        got.backward(out_grad)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_rows.grad, want_rows.grad, rtol=1e-12, atol=1e-12)
    owned = total[rank * local : (rank + 1) * local]
    torch.testing.assert_close(mine.grad, owned, rtol=1e-12, atol=1e-12)
    return route.send, route.recv, counter.stats


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [2, 4])
def test_dispatch_and_combine_equal_every_expert_run_locally(ranks: int) -> None:
    experts = 8
    results = run_on_ranks(_rank, ranks, ranks, experts)
    local = experts // ranks
    sizes = [_sizes(r, experts).view(ranks, local).sum(1).tolist() for r in range(ranks)]
    for rank, (send, recv, stats) in enumerate(results):
        assert send == sizes[rank]
        assert recv == [sizes[src][rank] for src in range(ranks)]
        # Forward: the counts (E int32), the rows out, their outputs back; backward: the
        # outputs' grads out and the rows' grads back. The rows to this rank itself are in
        # each buffer too; (sum - own) * DIM * 8 of each leave the rank.
        rows_bytes = (sum(send) + sum(recv)) * DIM * 8
        assert stats.count == {("all_to_all", "ep"): 5}
        assert stats.bytes == {("all_to_all", "ep"): experts * 4 + 2 * rows_bytes}
    assert sum(sum(send) for send, _, _ in results) > 0
