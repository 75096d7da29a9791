"""Ring attention: exact attention over a sequence split across the ``cp`` ranks.

Each rank keeps its queries and passes its K/V block to the next rank of the ring ``cp - 1``
times, so it sees every block once; the partial outputs are merged by their log-sum-exp.
The backward recomputes each block's probabilities from the saved final log-sum-exp and
passes K/V together with the dK/dV accumulated so far around the ring, then hands each
accumulated dK/dV back to its owner. Which rows of a block see which keys (and with what
mask, under a sliding window) is ``_block_plan.py``'s. A sliding window skips the blocks it
leaves out, and the ring steps that no rank attends at (``ring_steps``): the block passes
straight to the rank of the next step used, ``hops`` ranks ahead, and the last hop returns
dK/dV from wherever the last step used left them.

Each exchange is one functional ``all_to_all_single`` on the cp group whose only non-empty
split is ``rank -> rank + hops`` (1 without a window): P2P ops (``batch_isend_irecv``) are
not implemented by the in-process threaded group the multi-rank tests use, while
``all_to_all_single`` runs on gloo, NCCL (which lowers it to grouped send/recv, so only the
neighbour's bytes move) and the threaded group, is traced by ``torch.compile``, and is what
``d9d.core._comm_count`` counts. Per call, with ``n`` ring steps used (``cp`` without a
window): forward ``n - 1`` exchanges of (K, V); backward ``n - 1`` of (K, V, dK, dV) and,
unless ``n == 1``, a last one of (dK, dV). Tensors of one exchange travel as one byte buffer.

The group is read (its name, this rank's index, its size) before the autograd function, which
gets a str and two ints: torch 2.11's Dynamo can neither pass a process group object that is
not exactly ``ProcessGroup`` (the threaded test group's ``ProcessLocalGroup``) into an
``autograd.Function`` nor ask it for its rank, and ``context_parallel`` reads them when it
builds its runtime, so nothing of the group's is looked up while ``jit`` traces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from d9d.errors import IndivisibleError

from ._block_attention import MATH_BLOCK_ATTENTION, BlockAttention, compute_dtype, finite_or_zero
from ._block_plan import BlockTask, band_mask, block_tasks, ring_steps
from ._zigzag import LoadBalance, check_load_balance

__all__ = ["ring_attention", "ring_attention_on"]


def _pass_ahead(
    tensors: Sequence[torch.Tensor], hops: int, group_name: str, rank: int, cp: int
) -> torch.Tensor:
    """Start sending ``tensors`` to the cp rank ``hops`` ahead and receiving the ones of the
    rank ``hops`` behind."""
    # Widest dtype first, so every tensor starts at a byte offset its dtype can be viewed at.
    ordered = sorted(tensors, key=lambda t: -t.element_size())
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in ordered])
    send = [0] * cp
    recv = [0] * cp
    send[(rank + hops) % cp] = flat.numel()
    recv[(rank - hops) % cp] = flat.numel()
    return funcol.all_to_all_single(flat, recv, send, group_name)


def _received(pending: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Wait for an exchange started by :func:`_pass_ahead` and unpack it like ``like``."""
    flat = funcol.wait_tensor(pending)
    order = sorted(range(len(like)), key=lambda i: -like[i].element_size())
    out: list[torch.Tensor] = [flat] * len(like)
    offset = 0
    for i in order:
        size = like[i].numel() * like[i].element_size()
        out[i] = flat[offset : offset + size].view(like[i].dtype).view(like[i].shape)
        offset += size
    return out


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold a block's ``(out, lse)`` into the running ones, in place, stably (rows that saw no
    key yet in either, of ``lse`` ``-inf``, stay zero)."""
    merged = torch.logaddexp(lse, block_lse)
    safe = finite_or_zero(merged)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1))
    out.add_(block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(merged)


def _call(
    block: BlockAttention, task: BlockTask, q: torch.Tensor, k: torch.Tensor
) -> tuple[BlockAttention, dict[str, Any]]:
    """The backend and keywords for ``task`` on ``q`` rows and ``k`` columns (already cut):
    a band's mask, on the math version where ``block`` takes no mask."""
    mask = band_mask(task, q.shape[2], k.shape[2], q.device)
    if mask is None:
        return block, {"causal": task.causal}
    return (block if block.masks else MATH_BLOCK_ATTENTION), {"causal": False, "mask": mask}


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        group_name: str,
        rank: int,
        cp: int,
        causal: bool,
        zigzag: bool,
        scale: float,
        block: BlockAttention,
        window: int | None,
    ) -> torch.Tensor:
        batch, heads, seq, _ = q.shape
        dtype = compute_dtype(q.dtype)
        out = torch.zeros(batch, heads, seq, v.shape[-1], dtype=dtype, device=q.device)
        lse = torch.full((batch, heads, seq), float("-inf"), dtype=dtype, device=q.device)
        steps = ring_steps(seq, cp, causal=causal, zigzag=zigzag, window=window)
        k_cur, v_cur = k, v
        for step, following in zip(steps, [*steps[1:], cp], strict=True):
            # Start the next exchange before computing, so it overlaps with this block.
            pending = None
            if following < cp:
                pending = _pass_ahead((k_cur, v_cur), following - step, group_name, rank, cp)
            owner = (rank - step) % cp
            for task in block_tasks(
                rank, owner, seq, cp, causal=causal, zigzag=zigzag, window=window
            ):
                q_b, k_b = q[:, :, task.rows], k_cur[:, :, task.cols]
                impl, options = _call(block, task, q_b, k_b)
                block_out, block_lse = impl.forward(
                    q_b, k_b, v_cur[:, :, task.cols], scale=scale, **options
                )
                _merge(out[:, :, task.rows], lse[:, :, task.rows], block_out, block_lse)
            if pending is not None:
                k_cur, v_cur = _received(pending, (k_cur, v_cur))
        if sinks is not None:  # one more logit per row, of a zero value: scales rows down
            sink = sinks.to(dtype).view(1, heads, 1).expand_as(lse)
            merged = torch.logaddexp(lse, sink)
            out.mul_(torch.exp(lse - merged).unsqueeze(-1))
            lse = merged
        # Not a no-op .to(): torch 2.11's Dynamo hands the traced backward a zero ``dout`` for
        # an output that a no-op .to() (or .contiguous()) returned, so jitted cp grads were 0.
        result = out if out.dtype == q.dtype else out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, sinks)
        ctx.options = (group_name, rank, cp, causal, zigzag, scale, block, window, steps)
        return result

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group_name, rank, cp, causal, zigzag, scale, block, window, steps = ctx.options
        seq = q.shape[2]
        dtype = compute_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        k_cur, v_cur = k, v
        dk_cur = torch.zeros(k.shape, dtype=dtype, device=k.device)
        dv_cur = torch.zeros(v.shape, dtype=dtype, device=v.device)
        for step, following in zip(steps, [*steps[1:], cp], strict=True):
            owner = (rank - step) % cp
            for task in block_tasks(
                rank, owner, seq, cp, causal=causal, zigzag=zigzag, window=window
            ):
                rows, cols = task.rows, task.cols
                q_b, k_b = q[:, :, rows], k_cur[:, :, cols]
                impl, options = _call(block, task, q_b, k_b)
                dq_b, dk_b, dv_b = impl.backward(
                    q_b,
                    k_b,
                    v_cur[:, :, cols],
                    out[:, :, rows],
                    dout[:, :, rows],
                    lse[:, :, rows],
                    scale=scale,
                    **options,
                )
                dq[:, :, rows] += dq_b
                dk_cur[:, :, cols] += dk_b
                dv_cur[:, :, cols] += dv_b
            hops = following - step
            if following < cp:
                moving = (k_cur, v_cur, dk_cur, dv_cur)
                k_cur, v_cur, dk_cur, dv_cur = _received(
                    _pass_ahead(moving, hops, group_name, rank, cp), moving
                )
            elif step > 0:
                # The block held now belongs to rank + hops: one more exchange returns its grads.
                moving = (dk_cur, dv_cur)
                dk_cur, dv_cur = _received(_pass_ahead(moving, hops, group_name, rank, cp), moving)
        grads = (dq.to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype))
        sink_grad = _sink_grad(sinks, out, dout, lse) if ctx.needs_input_grad[3] else None
        return *grads, sink_grad, None, None, None, None, None, None, None, None


def _sink_grad(
    sinks: torch.Tensor | None, out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor | None:
    """The grad of the sink logits ``[H]`` from this rank's rows: a sink's value is zero, so
    its score's grad is ``-P_sink * rowsum(dO * O)`` (``lse`` includes the sinks)."""
    if sinks is None:
        return None
    dtype = lse.dtype
    delta = (dout.to(dtype) * out.to(dtype)).sum(dim=-1)
    p_sink = torch.exp(sinks.to(dtype).view(1, -1, 1) - lse)
    return (-(p_sink * delta)).sum(dim=(0, 2)).to(sinks.dtype)


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    load_balance: object,
    scale: float | None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> None:
    check_load_balance(load_balance)
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 1
    ):
        raise ValueError(
            f"{window=} must be an int >= 1 (keys a query sees, itself included) or None."
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4 or not t.is_floating_point():
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be a floating point tensor [batch, heads, seq, head_dim], got "
                f"{shape}."
            )
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not (q.shape[0] == k.shape[0] == v.shape[0] and q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(f"q, k and v must share batch (dim 0) and seq (dim 2): got {shapes}.")
    if q.shape[3] != k.shape[3] or k.shape[1] != v.shape[1]:
        raise ValueError(f"q and k must share head_dim, k and v their heads: got {shapes}.")
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(
            f"query heads {heads} are not a multiple of key/value heads {kv_heads} ({shapes}): "
            "grouped-query attention needs heads % kv_heads == 0."
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if load_balance == "zigzag" and q.shape[2] % 2:
        raise IndivisibleError(
            f"zigzag shards hold two equal chunks, but this rank's sequence length is "
            f"{q.shape[2]} (odd): the global length must be divisible by 2 * cp; pad or pack "
            "to a multiple of 2 * cp, or use load_balance=None."
        )
    if scale is not None and not (isinstance(scale, int | float) and 0 < scale < math.inf):
        raise ValueError(f"{scale=} must be a finite number > 0, or None for 1/sqrt(head_dim).")
    if sinks is not None and (
        not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (heads,)
    ):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(
            f"sinks must be one logit per query head, a tensor of shape ({heads},) ({shapes}); "
            f"got {shape}."
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    causal: bool = True,
    load_balance: LoadBalance = "zigzag",
    scale: float | None = None,
    block: BlockAttention = MATH_BLOCK_ATTENTION,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's queries over the sequence split across ``group``.

    Equals ``F.scaled_dot_product_attention`` on the unsharded sequence (with K/V heads
    repeated for grouped-query attention), restricted to this rank's query rows; gradients
    flow to this rank's ``q``, ``k`` and ``v``. Every rank of ``group`` must call it with the
    same shapes and options. Shards must be cut with :func:`shard_sequence` (or
    :func:`zigzag_shard`) of the same ``load_balance``. Communication: ``cp - 1`` exchanges
    of K/V with the ring neighbours in forward, ``cp`` in backward; fewer under a sliding
    window (see ``docs/context_parallel.md``).

    Args:
        q: This rank's queries ``[batch, heads, seq_local, head_dim]``.
        k: This rank's keys ``[batch, kv_heads, seq_local, head_dim]``; ``heads % kv_heads``
            must be 0 (query head ``h`` uses key/value head ``h // (heads // kv_heads)``).
        v: This rank's values ``[batch, kv_heads, seq_local, v_dim]``.
        group: The cp process group, e.g. ``mesh.get_group("cp")``.
        causal: Causal mask over global positions (default True).
        load_balance: ``"zigzag"`` (default) or ``None`` (contiguous chunks): the layout the
            sequence was split with.
        scale: Score scale (default ``1 / sqrt(head_dim)``).
        block: The per-block attention backend (default the pure-PyTorch math version).
        sinks: Attention sinks ``[heads]`` (default None): one more logit per query row and
            head, unscaled, of a zero value (GPT-OSS's ``sinks``), so each row's softmax
            has ``exp(sinks[h])`` more in its denominator; differentiable.
        window: A causal sliding window (default None): a query at global position ``q``
            sees the keys at ``q - window < k <= q`` (``transformers``' sliding window).
            Blocks it cuts across are attended with a mask, on the math version where
            ``block`` takes none (``block.masks``: the CUDA kernels), in float32 for
            bfloat16; blocks wholly outside it are skipped, and so are the exchanges of the
            ring steps no rank attends at.

    Returns:
        This rank's attention output ``[batch, heads, seq_local, v_dim]``, dtype of ``q``.

    Raises:
        ValueError: Shapes, dtypes, ``heads % kv_heads``, ``scale``, ``sinks``, ``window``
            or ``load_balance`` are invalid.
        NotImplementedError: A ``window`` shorter than the sequence with ``causal=False``.
        IndivisibleError: ``load_balance="zigzag"`` with an odd ``seq_local``.
        TypeError: ``group`` is not a process group.

    Example:
        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> ring_attention(q, k, v, group=dist.group.WORLD).shape
        torch.Size([1, 2, 4, 8])
        >>> dist.destroy_process_group()
    """
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group={group!r} must be a torch.distributed.ProcessGroup: pass the cp axis's "
            'group, e.g. mesh.get_group("cp").'
        )
    return ring_attention_on(
        q,
        k,
        v,
        group_name=group.group_name,
        rank=dist.get_rank(group),
        size=dist.get_world_size(group),
        causal=causal,
        load_balance=load_balance,
        scale=scale,
        block=block,
        sinks=sinks,
        window=window,
    )


def ring_attention_on(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group_name: str,
    rank: int,
    size: int,
    causal: bool = True,
    load_balance: LoadBalance = "zigzag",
    scale: float | None = None,
    block: BlockAttention = MATH_BLOCK_ATTENTION,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """:func:`ring_attention` on the group named ``group_name``, of ``size`` ranks, this rank
    being its ``rank``-th: what ``context_parallel`` calls, with the three read from its mesh
    when it builds its runtime, so a trace sees no process group object."""
    _validate(q, k, v, load_balance, scale, sinks, window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    zigzag = load_balance == "zigzag"
    if window is not None and window >= q.shape[2] * size:
        window = None  # it spans the sequence: no mask
    if window is not None and not causal:
        raise NotImplementedError(
            f"a sliding window ({window=}) without causal masking is not implemented (a "
            "bidirectional window is another mask: transformers' lets a query see keys at most "
            "window positions either side); pass causal=True, or window=None"
        )
    return _RingAttention.apply(
        q, k, v, sinks, group_name, rank, size, causal, zigzag, scale, block, window
    )
