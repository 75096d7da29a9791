"""Ring attention with a causal sliding window against attention with an explicit band mask
on the unsharded sequence: forward, dq, dk, dv and the sinks' grad, on both layouts; and its
exchanges against those of the ring steps the window needs, counted over positions."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from d9d.core._comm_count import CollectiveCounter
from d9d.parallel import (
    MATH_BLOCK_ATTENTION,
    positions_for,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)
from d9d.parallel._block_attention import BlockAttention
from d9d.parallel._block_plan import BlockTask, block_tasks
from d9d.parallel._ring_attention import _merge
from d9d.parallel._sdpa_block_attention import SDPA_BLOCK_ATTENTION
from d9d.testing import run_on_ranks

TOL = {"rtol": 1e-10, "atol": 1e-10}
SINKS = torch.linspace(-2.0, 3.0, 6, dtype=torch.float64)
# The CPU kernel as a backend that takes no mask: ring attention must run bands on the math one.
MASKLESS_SDPA = BlockAttention(
    "sdpa",
    lambda q, k, v, *, scale, causal: SDPA_BLOCK_ATTENTION.forward(
        q, k, v, scale=scale, causal=causal
    ),
    lambda q, k, v, out, dout, lse, *, scale, causal: SDPA_BLOCK_ATTENTION.backward(
        q, k, v, out, dout, lse, scale=scale, causal=causal
    ),
)


def _banded(q, k, v, sinks, window):
    """transformers' sliding window: a query at ``i`` sees keys ``j`` with ``i - window < j <= i``
    (``sliding_window_overlay`` and the causal mask); ``sinks`` as GPT-OSS's."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    pos = torch.arange(q.shape[2])
    back = pos.unsqueeze(-1) - pos
    mask = (back >= 0) & (back < window)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, -torch.inf)
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v


def _inputs(seq):
    gen = torch.Generator().manual_seed(0)
    shapes = [(2, 6, seq, 8), (2, 2, seq, 8), (2, 2, seq, 8), (2, 6, seq, 8)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def _rank(tensors, sinks, windows, load_balance, block):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    group = mesh.get_group("cp")
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    results = []
    for window in windows:
        q, k, v, dout = (
            shard_sequence(t, 2, rank, cp, load_balance=load_balance).requires_grad_()
            for t in tensors
        )
        s = None if sinks is None else sinks.clone().requires_grad_()
        with CollectiveCounter(mesh) as counted:
            out = ring_attention(
                q, k, v, group=group, load_balance=load_balance, block=block, sinks=s, window=window
            )
            out.backward(dout)
        grads = [out.detach(), q.grad, k.grad, v.grad]
        comms = (dict(counted.stats.count), dict(counted.stats.bytes))
        results.append((grads, None if s is None else s.grad, comms))
    return results


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("cp", "seq", "load_balance", "block"),
    [
        (2, 12, "zigzag", MATH_BLOCK_ATTENTION),
        (2, 12, "zigzag", SDPA_BLOCK_ATTENTION),
        (2, 12, "zigzag", MASKLESS_SDPA),
        (4, 24, "zigzag", SDPA_BLOCK_ATTENTION),
        (3, 15, None, MATH_BLOCK_ATTENTION),
        (3, 15, None, SDPA_BLOCK_ATTENTION),
    ],
    ids=[
        "zigzag2-math",
        "zigzag2-sdpa",
        "zigzag2-maskless",
        "zigzag4-sdpa",
        "chunks3-math",
        "chunks3-sdpa",
    ],
)
def test_sliding_window_matches_band_masked_attention(cp, seq, load_balance, block):
    """Windows of 1, under a chunk, a chunk (3 zigzag, 5 contiguous), across several chunks,
    and the whole sequence; GQA (6 heads over 2), sinks; the exchanges are those of the ring
    steps the window needs (all of them for the whole sequence: those without a window).
    Backends: math, the CPU kernel with its mask, and without (math for bands)."""
    _check(cp, seq, load_balance, block, SINKS)


@pytest.mark.distributed
def test_sliding_window_without_sinks():
    _check(2, 12, "zigzag", SDPA_BLOCK_ATTENTION, None)


def _check(cp, seq, load_balance, block, sinks):
    chunk = seq // (2 * cp if load_balance else cp)
    windows = [1, chunk - 1, chunk, 2 * chunk + 1, seq]
    tensors = _inputs(seq)
    ranks = run_on_ranks(_rank, cp, tensors, sinks, windows, load_balance, block)
    for i, window in enumerate(windows):
        q, k, v, dout = (t.clone().requires_grad_() for t in tensors)
        s = None if sinks is None else sinks.clone().requires_grad_()
        expected = _banded(q, k, v, s, window)
        expected.backward(dout)
        got = [
            unshard_sequence([r[i][0][j] for r in ranks], 2, load_balance=load_balance)
            for j in range(4)
        ]
        for actual, want in zip(got, [expected, q.grad, k.grad, v.grad], strict=True):
            torch.testing.assert_close(actual, want.detach(), **TOL)
        if sinks is not None:
            sink_grad = torch.stack([r[i][1] for r in ranks]).sum(0)
            torch.testing.assert_close(sink_grad, s.grad, **TOL)
        count, size = _analytic_exchanges(cp, seq, load_balance, window, k.numel() * 8 // cp)
        key = ("all_to_all", "cp")
        for r in ranks:
            assert r[i][2] == (({key: count}, {key: size}) if count else ({}, {}))


def _analytic_exchanges(cp, seq, load_balance, window, kv_bytes):
    """Count and bytes of a call's exchanges, from positions alone: ring step ``s`` brings
    rank ``r`` the block of rank ``r - s``, and is needed if some query of some rank sees
    some key of that block (``q - window < k <= q``). Forward: one exchange of K, V per
    needed step after the first (own) one; backward: one of K, V, dK, dV each, and one of
    dK, dV back to the owners; ``kv_bytes`` is one rank's K (float64, as V, dK and dV)."""
    pos = [positions_for(r, cp, seq, load_balance=load_balance) for r in range(cp)]
    needed = 0
    for step in range(cp):
        back = [pos[r].unsqueeze(-1) - pos[(r - step) % cp] for r in range(cp)]
        needed += any(((b >= 0) & (b < window)).any() for b in back)
    moves = needed - 1
    count = 2 * moves + (moves > 0)
    return count, kv_bytes * (2 * moves + 4 * moves + 2 * (moves > 0))


def test_window_needs_causal_and_a_positive_int(one_rank_mesh):
    q = torch.randn(1, 2, 4, 8)
    group = one_rank_mesh.get_group()
    with pytest.raises(NotImplementedError, match="without causal masking"):
        ring_attention(q, q, q, group=group, causal=False, window=2)
    for window in (0, True, 2.0):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            ring_attention(q, q, q, group=group, window=window)


def test_rows_that_saw_no_key_merge_to_zero():
    """A masked row with no key has a zero output and an lse of -inf; merged into a running
    row that saw none yet it stays zero, not NaN, and a later block fills it."""
    q = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    mask = torch.tensor([[False, False], [True, False]])
    block_out, block_lse = MATH_BLOCK_ATTENTION.forward(q, q, q, scale=0.5, causal=False, mask=mask)
    assert block_out[0, 0, 0].eq(0).all() and block_lse[0, 0, 0] == -torch.inf
    out = torch.zeros_like(block_out)
    lse = torch.full_like(block_lse, -torch.inf)
    _merge(out, lse, block_out, block_lse)
    assert out[0, 0, 0].eq(0).all() and out.isfinite().all()
    torch.testing.assert_close(out[0, 0, 1], block_out[0, 0, 1])


def test_the_exchanges_counted_match_the_window_geometry():
    """The analytic count itself, by hand: zigzag cp=4 with chunks of 3 and a window of 3
    needs the blocks 1 and 3 ring steps back (a rank's early chunk sees the previous rank's,
    its late chunk the next rank's late one) but not 2, which a window of 7 reaches; a window
    of 1 needs no other block; contiguous chunks of 5, a window of 5, only the previous one."""
    assert _analytic_exchanges(4, 24, "zigzag", 24, 1) == (7, 6 * 3 + 2)
    assert _analytic_exchanges(4, 24, "zigzag", 3, 1) == (5, 6 * 2 + 2)
    assert _analytic_exchanges(4, 24, "zigzag", 7, 1) == (7, 6 * 3 + 2)
    assert _analytic_exchanges(4, 24, "zigzag", 1, 1) == (0, 0)
    assert _analytic_exchanges(3, 15, None, 5, 1) == (3, 6 + 2)


def test_a_window_skips_the_chunks_it_leaves_out():
    """Zigzag cp=4, chunks of 3: a window of 1 runs each rank's two own chunks only (a band,
    as a chunk of 3 is wider than the window); one of 3 adds the neighbouring chunk's keys,
    cropped to the 2 of them a row sees; no call reaches a chunk further back."""
    plan = {
        window: {
            (rank, owner): block_tasks(rank, owner, 6, 4, causal=True, zigzag=True, window=window)
            for rank in range(4)
            for owner in range(4)
        }
        for window in (1, 3)
    }
    for (rank, owner), tasks in plan[1].items():
        assert len(tasks) == (2 if owner == rank else 0)
        assert all(t.band is not None for t in tasks)
    # Rank 1 holds chunks 1 and 6; rank 0 chunks 0 and 7: chunk 1 sees chunk 0's last 2 keys,
    # chunk 7 sees chunk 6's.
    assert plan[3][1, 0] == [BlockTask(slice(0, 2), slice(1, 3), False, band=(3, 1, 3))]
    assert plan[3][0, 1] == [BlockTask(slice(3, 5), slice(4, 6), False, band=(21, 19, 3))]
    assert plan[3][3, 0] == []  # chunks 3, 4 against 0, 7: 7 is after both, 0 too far back
