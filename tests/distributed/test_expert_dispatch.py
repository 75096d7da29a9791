"""``d9d.kernels.dispatch``/``combine``: the ``c10d`` and ``reference`` backends against
every expert run locally on each rank's tokens (float64, odd token counts, top-1 to top-3):
outputs, the grads of the tokens, the routing weights and the owners' experts, the rows and
group sizes the two backends hand the experts, and the ``c10d`` all-to-all bytes derived from
the routing; skewed routing (every token on one expert; experts empty on every rank; a rank
with no tokens); the meta (fake) shapes ``d9d plan`` sees and its uniform-routing sizes."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

import d9d
import d9d.kernels as K
from d9d.core._comm_count import CollectiveCounter
from d9d.kernels._moe_dispatch_c10d import uniform_split
from d9d.testing import fake_world, run_on_ranks

DIM, EXPERTS = 5, 8
TOL = {"rtol": 1e-12, "atol": 1e-12}
CASES = ("random", "one expert", "empty experts", "silent rank")


def _tokens(rank: int, case: str) -> int:
    return 0 if case == "silent rank" and rank == 1 else 5 + 2 * rank  # odd


def _ids(rank: int, ranks: int, k: int, case: str) -> torch.Tensor:
    """Each token's ``k`` distinct experts: random ones, experts ``0 .. k-1`` for every
    token, or drawn from the first half of every rank's experts (the rest empty everywhere)."""
    local = EXPERTS // ranks
    if case == "one expert":
        return torch.arange(k).expand(_tokens(rank, case), k).clone()
    pool = [e for e in range(EXPERTS) if case != "empty experts" or e % local < max(1, local // 2)]
    g = torch.Generator().manual_seed(10 * rank + k)
    picks = [torch.randperm(len(pool), generator=g)[:k] for _ in range(_tokens(rank, case))]
    ids = torch.stack(picks) if picks else torch.zeros(0, k, dtype=torch.long)
    return torch.tensor(pool)[ids]


def _local_oracle(x, ids, weights, w):
    """``sum_j weights[t, j] * x[t] @ w[ids[t, j]]``, every expert on this rank."""
    return torch.einsum("tj,tjd->td", weights, torch.einsum("td,tjde->tje", x, w[ids]))


def _experts(rows: torch.Tensor, sizes: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    parts = [part @ wi for part, wi in zip(rows.split(sizes.tolist()), w, strict=True)]
    return torch.cat(parts)


def _run(backend, x, ids, weights, w_local, group, grad):
    x, weights, w_local = (t.clone().requires_grad_() for t in (x, weights, w_local))
    layout = K.dispatch_layout(ids, EXPERTS, group.size())
    rows, sizes, handle = K.dispatch(x, ids, weights, layout, group, backend=backend)
    out = K.combine(_experts(rows, sizes, w_local), handle)
    out.backward(grad)
    return out, x.grad, weights.grad, w_local.grad, rows.detach(), sizes


def _rank(ranks: int, case: str) -> list[dict[tuple[str, int], object]]:
    mesh = d9d.make_mesh("cpu", ep=ranks)
    group, rank, local = mesh.get_group("ep"), dist.get_rank(), EXPERTS // ranks
    w = torch.randn(EXPERTS, DIM, DIM, generator=torch.Generator().manual_seed(9)).double()
    mine = slice(rank * local, (rank + 1) * local)
    stats = {}
    for k in (1, 2, 3):
        ids = _ids(rank, ranks, k, case)
        g = torch.Generator().manual_seed(100 * rank + k)
        x = torch.randn(ids.shape[0], DIM, generator=g).double()
        weights = torch.rand(ids.shape, generator=g).double()
        grad = torch.randn(x.shape, generator=g).double()
        want_x, want_weights, want_w = (t.clone().requires_grad_() for t in (x, weights, w))
        want = _local_oracle(want_x, ids, want_weights, want_w)
        want.backward(grad)
        owned = want_w.grad.clone()
        dist.all_reduce(owned)  # every rank's rows pass through the owner's experts
        results = {}
        for backend in ("c10d", "reference"):
            with CollectiveCounter(mesh) as counter:
                results[backend] = _run(backend, x, ids, weights, w[mine], group, grad)
            stats[(backend, k)] = counter.stats
        for out, dx, dweights, dw, _, _ in results.values():
            torch.testing.assert_close(out, want, **TOL)
            torch.testing.assert_close(dx, want_x.grad, **TOL)
            torch.testing.assert_close(dweights, want_weights.grad, **TOL)
            torch.testing.assert_close(dw, owned[mine], **TOL)
        # Both hand the experts the same rows in the same order.
        assert torch.equal(results["c10d"][4], results["reference"][4])
        assert torch.equal(results["c10d"][5], results["reference"][5])
    return stats


def _off_rank(ranks: int, case: str, k: int, rank: int) -> tuple[int, int]:
    """Tokens ``rank`` sends to other ranks and receives from them, once per rank."""
    local = EXPERTS // ranks

    def reaching(src: int, dst: int) -> int:
        return int(((_ids(src, ranks, k, case) // local) == dst).any(1).sum())

    others = [r for r in range(ranks) if r != rank]
    return sum(reaching(rank, d) for d in others), sum(reaching(s, rank) for s in others)


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_c10d_and_reference_equal_every_expert_run_locally(ranks: int, case: str) -> None:
    """Per k, the c10d backend's all-to-alls on 'ep': the counts (R x (L + 1) int64), then
    the tokens that leave the rank (dim float64), their ids (k int32) and weights (k float64)
    out, one row per received token back; backward: the rows' grads out, the tokens' and
    weights' grads back. Only tokens routed off-rank are counted, once per destination."""
    results = run_on_ranks(_rank, ranks, ranks, case, timeout=120)
    local = EXPERTS // ranks
    moved = 0
    for rank, stats in enumerate(results):
        for k in (1, 2, 3):
            sent, received = _off_rank(ranks, case, k, rank)
            moved += sent
            want = ranks * (local + 1) * 8 + 2 * (sent + received) * DIM * 8
            want += sent * k * 4 + (sent + received) * k * 8
            assert stats[("c10d", k)].count == {("all_to_all", "ep"): 8}
            assert stats[("c10d", k)].bytes == {("all_to_all", "ep"): want}
            assert ("all_to_all", "ep") not in stats[("reference", k)].count
    assert moved > 0


def test_uniform_split_is_the_expected_count_over_every_choice_of_experts() -> None:
    """Tokens per rank: T times the mean, over every set of k of E experts, of the share of
    ranks it reaches (enumerated), rounded half up; choices: T * k split evenly."""
    for experts, k, ranks, tokens in ((6, 2, 2, 64), (8, 3, 4, 7), (12, 4, 3, 33), (4, 1, 4, 9)):
        local = experts // ranks
        subsets = list(itertools.combinations(range(experts), k))
        mean = Fraction(sum(len({e // local for e in s}) for s in subsets), len(subsets) * ranks)
        per_rank, choices = uniform_split(tokens, experts, k, ranks)
        assert per_rank == math.floor(tokens * mean + Fraction(1, 2))
        assert sum(choices) == tokens * k and max(choices) - min(choices) <= 1
    assert uniform_split(7, 8, 3, 4)[0] == 5  # 7 * (1 - C(6,3)/C(8,3)) = 4.5, half up


def test_fake_dispatch_and_combine_have_the_uniform_shapes() -> None:
    """On meta tensors of a simulated 4-rank group (d9d plan): 7 tokens, top-3 of 8 experts,
    rank 1: 21 choices over 8 experts (3, 3, 3, 3, 3, 2, 2, 2), rank 1's experts 2 and 3 get
    3 + 3 from each of 4 ranks: 24 rows; combine returns the 7 tokens."""
    with fake_world(4, rank=1):
        group = d9d.make_mesh("cpu", ep=4).get_group("ep")
        x = torch.empty(7, DIM, device="meta", requires_grad=True)
        ids = torch.empty(7, 3, dtype=torch.long, device="meta")
        weights = torch.empty(7, 3, device="meta", requires_grad=True)
        with CollectiveCounter(d9d.make_mesh("cpu", ep=4)) as counter:
            layout = K.dispatch_layout(ids, EXPERTS, 4)
            rows, sizes, handle = K.dispatch(x, ids, weights, layout, group)
            out = K.combine(rows * 2, handle)
        assert rows.shape == (24, DIM) and sizes.shape == (2,) and out.shape == (7, DIM)
        assert out.is_meta and handle.received == 4 * 5
        # 5 tokens to each of the 3 other ranks and back: counts, tokens, ids, weights, rows.
        sent = 3 * 5
        want = 4 * 3 * 8 + sent * DIM * 4 + sent * 3 * 4 + sent * 3 * 4 + sent * DIM * 4
        assert counter.stats.bytes == {("all_to_all", "ep"): want}
