"""Ring attention against full attention on the unsharded sequence, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from d9d.core._comm_count import CollectiveCounter
from d9d.errors import IndivisibleError
from d9d.parallel import (
    MATH_BLOCK_ATTENTION,
    positions_for,
    ring_attention,
    shard_sequence,
    unshard_sequence,
    zigzag_shard,
    zigzag_unshard,
)
from d9d.parallel._ring_attention import ring_attention_on
from d9d.parallel._sdpa_block_attention import SDPA_BLOCK_ATTENTION
from d9d.testing import run_on_ranks

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float64: {"rtol": 1e-10, "atol": 1e-10}}


def _full_attention(q, k, v, *, causal, scale=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _inputs(heads, kv_heads, seq, dtype, *, batch=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, seq, dim), (batch, kv_heads, seq, dim), (batch, kv_heads, seq, dim)]
    q, k, v, dout = (torch.randn(s, generator=gen, dtype=dtype) for s in [*shapes, shapes[0]])
    return q, k, v, dout


def _rank(mesh_shape, names, tensors, causal, load_balance, scale=None, block=MATH_BLOCK_ATTENTION):
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    group = mesh.get_group("cp")
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    # Models produce [B, S, H, D] and transpose it: test that non-contiguous layout.
    q, k, v, dout = (
        shard_sequence(t, 2, rank, cp, load_balance=load_balance)
        .transpose(1, 2)
        .contiguous()
        .transpose(1, 2)
        .requires_grad_()
        for t in tensors
    )
    assert not q.is_contiguous()
    with CollectiveCounter(mesh) as forward:
        out = ring_attention(
            q, k, v, group=group, causal=causal, load_balance=load_balance, scale=scale, block=block
        )
    with CollectiveCounter(mesh) as backward:
        out.backward(dout)
    counts = (dict(forward.stats.count), dict(backward.stats.count))
    return out.detach(), q.grad, k.grad, v.grad, counts


def _check(
    cp,
    heads,
    kv_heads,
    seq,
    dtype,
    causal,
    load_balance,
    *,
    dp=1,
    scale=None,
    tol=None,
    method="thread",
    block=MATH_BLOCK_ATTENTION,
):
    tensors = _inputs(heads, kv_heads, seq, dtype)
    shape, names = ((dp, cp), ("dp", "cp")) if dp > 1 else ((cp,), ("cp",))
    results = run_on_ranks(
        _rank, dp * cp, shape, names, tensors, causal, load_balance, scale, block, method=method
    )
    q, k, v, dout = (t.clone().requires_grad_() for t in tensors)
    expected = _full_attention(q, k, v, causal=causal, scale=scale)
    expected.backward(dout)
    for row in range(dp):
        ranks = results[row * cp : (row + 1) * cp]
        got = [
            unshard_sequence([r[i] for r in ranks], 2, load_balance=load_balance) for i in range(4)
        ]
        for actual, want in zip(got, [expected, q.grad, k.grad, v.grad], strict=True):
            torch.testing.assert_close(actual, want.detach(), **(tol or TOL[dtype]))
        for *_, (forward, backward) in ranks:
            assert forward == ({("all_to_all", "cp"): cp - 1} if cp > 1 else {})
            assert backward == ({("all_to_all", "cp"): cp} if cp > 1 else {})


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(("heads", "kv_heads"), [(3, 1), (6, 2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("load_balance", ["zigzag", None])
@pytest.mark.parametrize("chunks", [1, 3])
def test_matches_full_attention_float64(cp, heads, kv_heads, causal, load_balance, chunks):
    _check(cp, heads, kv_heads, 2 * cp * chunks, torch.float64, causal, load_balance)


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("load_balance", ["zigzag", None])
def test_matches_full_attention_float32(cp, causal, load_balance):
    _check(cp, 3, 1, 6 * cp, torch.float32, causal, load_balance)


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(("heads", "kv_heads"), [(3, 1), (6, 2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sdpa_blocks_match_full_attention(cp, heads, kv_heads, causal, dtype):
    """The fused CPU SDPA kernel with log-sum-exp as the per-block attention."""
    _check(cp, heads, kv_heads, 6 * cp, dtype, causal, "zigzag", block=SDPA_BLOCK_ATTENTION)


def _attention_with_sinks(q, k, v, sinks, *, causal):
    """GPT-OSS's eager attention: one more logit per row, ``sinks[h]``, of a zero value."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(~torch.ones_like(scores, dtype=torch.bool).tril(), -torch.inf)
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v


def _sinks_rank(tensors, sinks, causal, load_balance, block):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    group = mesh.get_group("cp")
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    q, k, v, dout = (
        shard_sequence(t, 2, rank, cp, load_balance=load_balance).requires_grad_() for t in tensors
    )
    sinks = sinks.clone().requires_grad_()
    out = ring_attention(
        q, k, v, group=group, causal=causal, load_balance=load_balance, block=block, sinks=sinks
    )
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad, sinks.grad


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("load_balance", ["zigzag", None])
@pytest.mark.parametrize(
    "block", [MATH_BLOCK_ATTENTION, SDPA_BLOCK_ATTENTION], ids=["math", "sdpa"]
)
def test_attention_sinks_match_full_attention(cp, causal, load_balance, block):
    """Sinks (GPT-OSS's ``s_aux``) scale each row by its share of the softmax after the ring's
    merge; their grads are the rank's rows' share, summed over ranks here (as cp's grads are)."""
    tensors = _inputs(6, 2, 4 * cp, torch.float64)
    sinks = torch.linspace(-2.0, 3.0, 6, dtype=torch.float64)
    results = run_on_ranks(_sinks_rank, cp, tensors, sinks, causal, load_balance, block)
    q, k, v, dout = (t.clone().requires_grad_() for t in tensors)
    want_sinks = sinks.clone().requires_grad_()
    expected = _attention_with_sinks(q, k, v, want_sinks, causal=causal)
    expected.backward(dout)
    got = [
        unshard_sequence([r[i] for r in results], 2, load_balance=load_balance) for i in range(4)
    ]
    for actual, want in zip(got, [expected, q.grad, k.grad, v.grad], strict=True):
        torch.testing.assert_close(actual, want.detach(), **TOL[torch.float64])
    sink_grad = torch.stack([r[4] for r in results]).sum(0)
    torch.testing.assert_close(sink_grad, want_sinks.grad, **TOL[torch.float64])


@pytest.mark.distributed
@pytest.mark.parametrize("sinks_dtype", [torch.bfloat16, torch.float32])
def test_bfloat16_attention_with_sinks_of_either_dtype(sinks_dtype):
    """bfloat16 q/k/v with sinks kept in bfloat16 or float32 (Flint keeps them float32): the
    sinks join the float32 merge and their grad comes back in their own dtype."""
    tensors = [t.to(torch.bfloat16) for t in _inputs(6, 2, 8, torch.float64)]
    sinks = torch.linspace(-2.0, 3.0, 6).to(sinks_dtype)
    results = run_on_ranks(_sinks_rank, 2, tensors, sinks, True, "zigzag", MATH_BLOCK_ATTENTION)
    q, k, v, dout = (t.double().requires_grad_() for t in tensors)
    want_sinks = sinks.double().requires_grad_()
    expected = _attention_with_sinks(q, k, v, want_sinks, causal=True)
    expected.backward(dout)
    got = [unshard_sequence([r[i] for r in results], 2, load_balance="zigzag") for i in range(4)]
    tol = {"rtol": 2e-2, "atol": 2e-2}
    for actual, want in zip(got, [expected, q.grad, k.grad, v.grad], strict=True):
        torch.testing.assert_close(actual.double(), want.detach(), **tol)
    sink_grads = [r[4] for r in results]
    assert all(g.dtype == sinks_dtype for g in sink_grads)
    torch.testing.assert_close(torch.stack(sink_grads).double().sum(0), want_sinks.grad, **tol)


@pytest.mark.parametrize(("seq_q", "seq_k", "causal"), [(5, 5, True), (3, 7, False), (6, 6, False)])
def test_sdpa_block_equals_math_block(seq_q, seq_k, causal):
    """Forward (output, log-sum-exp) and backward from a final output and log-sum-exp, on odd
    sizes with grouped-query heads."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, seq_q, 5, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, seq_k, 5, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, seq_k, 7, generator=gen, dtype=torch.float64)
    dout = torch.randn(2, 6, seq_q, 7, generator=gen, dtype=torch.float64)
    options = {"scale": 0.3, "causal": causal}
    out, lse = MATH_BLOCK_ATTENTION.forward(q, k, v, **options)
    got = SDPA_BLOCK_ATTENTION.forward(q, k, v, **options)
    torch.testing.assert_close(got, (out, lse), rtol=1e-12, atol=1e-12)
    want = MATH_BLOCK_ATTENTION.backward(q, k, v, out, dout, lse, **options)
    got = SDPA_BLOCK_ATTENTION.backward(q, k, v, out, dout, lse, **options)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_sdpa_block_reads_a_strided_last_dim():
    """q, k, v, out and dout whose last dim has stride 2 (every other column of a wider
    tensor) give what their dense copies give: the fused kernel reads rows as dense."""
    gen = torch.Generator().manual_seed(4)

    def every_other_column(*shape: int) -> torch.Tensor:
        wide = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)
        return wide[..., ::2]

    q, k, v = (every_other_column(2, 2, 5, 6) for _ in range(3))  # one head per K/V head
    dense_qkv = (q.contiguous(), k.contiguous(), v.contiguous())
    options = {"scale": 0.3, "causal": True}
    out, lse = SDPA_BLOCK_ATTENTION.forward(*dense_qkv, **options)
    torch.testing.assert_close(SDPA_BLOCK_ATTENTION.forward(q, k, v, **options), (out, lse))
    dout = every_other_column(*out.shape)
    want = SDPA_BLOCK_ATTENTION.backward(*dense_qkv, out, dout.contiguous(), lse, **options)
    strided_out = torch.stack([out, out], dim=-1)[..., 0]
    got = SDPA_BLOCK_ATTENTION.backward(q, k, v, strided_out, dout, lse, **options)
    torch.testing.assert_close(got, want)


def test_block_attention_backend_comes_from_the_registry():
    from d9d import kernels
    from d9d.kernels._registry import resolve

    q = torch.ones(1, 2, 4, 8)
    assert resolve("block_attention", q, None) is MATH_BLOCK_ATTENTION
    with kernels.use(block_attention="sdpa"):
        assert resolve("block_attention", q, None) is SDPA_BLOCK_ATTENTION
    assert kernels.available()["block_attention"]["sdpa"] is None


@pytest.mark.distributed
def test_cp_group_of_a_2d_mesh_and_custom_scale():
    """Ring neighbours are cp-group ranks, not global ranks: dp=2 x cp=2."""
    _check(2, 6, 2, 8, torch.float64, True, "zigzag", dp=2, scale=0.3)


@pytest.mark.distributed
def test_gloo_processes():
    """Real gloo: the exchange's uneven all_to_all_single of bytes, between processes."""
    _check(4, 6, 2, 16, torch.float64, True, "zigzag", method="fork")


@pytest.mark.distributed
def test_one_rank_is_plain_attention():
    _check(1, 4, 2, 6, torch.float64, True, "zigzag")


@pytest.mark.distributed
def test_bfloat16_mixes_dtypes_in_one_exchange():
    """bf16 K/V travel with float32 dK/dV in one byte buffer in the backward."""
    _check(2, 3, 1, 12, torch.bfloat16, True, "zigzag", tol={"rtol": 2e-2, "atol": 2e-2})


def test_zigzag_layout_and_positions():
    x = torch.arange(16)
    shards = [zigzag_shard(x, 0, r, 4) for r in range(4)]
    assert shards[1].tolist() == [2, 3, 12, 13]
    assert torch.equal(zigzag_unshard(shards, 0), x)
    for r in range(4):
        assert torch.equal(positions_for(r, 4, 16), shards[r])
        contiguous = positions_for(r, 4, 16, load_balance=None)
        assert contiguous.tolist() == list(range(4 * r, 4 * r + 4))
    # Equal causal work: each rank's queries see the same number of keys in total.
    work = {int((positions_for(r, 4, 16) + 1).sum()) for r in range(4)}
    assert len(work) == 1


def test_shard_sequence_round_trips_other_dims():
    x = torch.randn(2, 12, 3)
    for load_balance in ["zigzag", None]:
        parts = [shard_sequence(x, -2, r, 3, load_balance=load_balance) for r in range(3)]
        assert torch.equal(unshard_sequence(parts, 1, load_balance=load_balance), x)


def test_indivisible_sequence_names_value_and_fix():
    with pytest.raises(IndivisibleError, match=r"length 12 is not divisible by 2 \* cp = 8"):
        zigzag_shard(torch.zeros(12), 0, 0, 4)
    with pytest.raises(IndivisibleError, match=r"length 10 is not divisible by cp = 4.*pad"):
        positions_for(0, 4, 10, load_balance=None)
    with pytest.raises(IndivisibleError, match=r"length along dim=0 is 3 \(odd\)"):
        zigzag_unshard([torch.zeros(3), torch.zeros(3)], 0)


def test_bad_split_arguments():
    with pytest.raises(ValueError, match=r"load_balance='ring' is not a load balancing"):
        positions_for(0, 2, 8, load_balance="ring")
    with pytest.raises(ValueError, match=r"rank=2 must be an int in \[0, 2\)"):
        positions_for(2, 2, 8)
    with pytest.raises(ValueError, match=r"cp=0 must be an int >= 1"):
        positions_for(0, 0, 8)
    with pytest.raises(ValueError, match=r"dim=2 is out of range"):
        shard_sequence(torch.zeros(4, 4), 2, 0, 2)
    with pytest.raises(ValueError, match="shards is empty"):
        unshard_sequence([], 0)
    with pytest.raises(ValueError, match=r"shards must all have one shape"):
        unshard_sequence([torch.zeros(4), torch.zeros(2)], 0)


def test_ring_attention_input_errors(one_rank_mesh):
    group = one_rank_mesh.get_group()
    q, k, v, _ = _inputs(4, 2, 4, torch.float32)
    with pytest.raises(TypeError, match=r"must be a torch.distributed.ProcessGroup"):
        ring_attention(q, k, v, group=one_rank_mesh)
    with pytest.raises(ValueError, match=r"query heads 4 are not a multiple of key/value heads 3"):
        ring_attention(q, *_inputs(4, 3, 4, torch.float32)[1:3], group=group)
    with pytest.raises(IndivisibleError, match=r"sequence length is 3 \(odd\).*2 \* cp"):
        ring_attention(*_inputs(4, 2, 3, torch.float32)[:3], group=group)
    ring_attention(*_inputs(4, 2, 3, torch.float32)[:3], group=group, load_balance=None)
    with pytest.raises(ValueError, match=r"must share batch \(dim 0\) and seq \(dim 2\)"):
        ring_attention(q, k[:, :, :2], v, group=group)
    with pytest.raises(ValueError, match=r"q and k must share head_dim"):
        ring_attention(q, k[..., :4], v, group=group)
    with pytest.raises(ValueError, match=r"q must be a floating point tensor.*\(4, 8\)"):
        ring_attention(q[0, 0], k, v, group=group)
    with pytest.raises(ValueError, match=r"must share a dtype"):
        ring_attention(q, k.double(), v, group=group)
    with pytest.raises(ValueError, match=r"scale=-1.0 must be a finite number > 0"):
        ring_attention(q, k, v, group=group, scale=-1.0)
    with pytest.raises(ValueError, match=r"load_balance='ring'"):
        ring_attention(q, k, v, group=group, load_balance="ring")
    with pytest.raises(
        ValueError, match=r"sinks must be one logit per query head.*\(4,\).*got \(2,\)"
    ):
        ring_attention(q, k, v, group=group, sinks=torch.zeros(2))


def _ring(mesh):
    """The cp group as ``context_parallel`` passes it into a trace: its name, this rank's index
    and its size (torch 2.11's Dynamo cannot query the threaded group's object)."""
    group = mesh.get_group("cp")
    return {"group_name": group.group_name, "rank": dist.get_rank(group), "size": 2}


def _compiled_rank(tensors):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    ring = _ring(mesh)
    q, k, v = (zigzag_shard(t, 2, ring["rank"], 2).requires_grad_() for t in tensors[:3])

    def loss(q, k, v):
        return ring_attention_on(q, k, v, **ring).square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    expected = torch.autograd.grad(loss(q, k, v), (q, k, v))
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    return expected, got


@pytest.mark.distributed
@pytest.mark.compile  # aot_eager: checks tracing of the autograd.Function and its collectives
def test_traces_with_fullgraph():
    for expected, got in run_on_ranks(_compiled_rank, 2, _inputs(4, 2, 8, torch.float64)):
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, **TOL[torch.float64])


def _grads_compiled_rank(tensors):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    ring = _ring(mesh)
    q, k, v = (zigzag_shard(t, 2, ring["rank"], 2) for t in tensors[:3])

    def grads(q, k, v):  # differentiated inside the compiled region, as under d9d.jit
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            loss = ring_attention_on(q, k, v, **ring).square().sum()
            return torch.autograd.grad(loss, (q, k, v))

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got = torch.compile(grads, backend="aot_eager")(q, k, v)
    return grads(q, k, v), got


@pytest.mark.distributed
@pytest.mark.compile  # aot_eager
def test_grads_taken_inside_the_compiled_region_equal_eager():
    """torch 2.11's Dynamo handed the traced backward a zero ``dout`` when the forward returned
    the buffer it had merged into in place."""
    results = run_on_ranks(_grads_compiled_rank, 2, _inputs(4, 2, 8, torch.float64))
    for expected, got in results:
        assert any(e.abs().max() > 0 for e in expected)
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, **TOL[torch.float64])
