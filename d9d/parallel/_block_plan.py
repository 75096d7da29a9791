"""Which of this rank's query rows see which keys of one rank's K/V block, and how masked.

Without a window (and with one that spans the sequence) a block is one call: causal
attention makes it invisible, fully visible, or the causal diagonal, per the layout. A
sliding window (a query at ``q`` sees a key at ``k`` iff ``q - window < k <= q``, as
``transformers``' sliding window overlay on its causal mask) cuts blocks anywhere, so each
pair of a query chunk and a key chunk (two per rank under zigzag, one contiguous) is
cropped to the rows and columns that see anything, then classified: fully visible, the
causal diagonal, or a band that needs a mask ``[rows, cols]``. A ring step (the blocks
``step`` ranks back) that no rank's plan uses is skipped, exchange and all: ``ring_steps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BlockTask", "band_mask", "block_tasks", "ring_steps"]

_ALL = slice(None)


@dataclass(frozen=True)
class BlockTask:
    """One block attention call: ``rows`` of the queries against ``cols`` of the K/V block.

    Attributes:
        rows: The query rows (local positions).
        cols: The key columns (local positions in the block).
        causal: The causal diagonal (``rows`` and ``cols`` hold the same positions).
        band: ``(first row, first column, window)``, the rows' and columns' first global
            positions, when the window cuts across the pair (a mask is needed), else None.
    """

    rows: slice
    cols: slice
    causal: bool
    band: tuple[int, int, int] | None = None


def _causal_plan(rank: int, owner: int, seq_local: int, *, zigzag: bool) -> list[BlockTask]:
    """The plan without a window. Zigzag: rank ``r`` holds chunks ``r`` and ``2cp-1-r``. A
    block from ``j < r`` is visible only through its early chunk (``j < r``; its late chunk
    is after both of ours), fully; a block from ``j > r`` is visible, fully, only to our
    late chunk. So every off-diagonal block is half a block of unmasked work on every rank."""
    if owner == rank:
        return [BlockTask(_ALL, _ALL, True)]
    if not zigzag:
        return [BlockTask(_ALL, _ALL, False)] if owner < rank else []
    half = seq_local // 2
    if owner < rank:
        return [BlockTask(_ALL, slice(0, half), False)]
    return [BlockTask(slice(half, seq_local), _ALL, False)]


def _chunks(rank: int, cp: int, seq_local: int, zigzag: bool) -> list[tuple[int, int]]:
    """``(local start, global start)`` of each chunk rank ``rank`` holds, all of one length."""
    if not zigzag:
        return [(0, rank * seq_local)]
    half = seq_local // 2
    return [(0, rank * half), (half, (2 * cp - 1 - rank) * half)]


def _window_plan(
    rank: int, owner: int, seq_local: int, cp: int, *, zigzag: bool, window: int
) -> list[BlockTask]:
    """The plan under a causal sliding ``window``: one call per chunk pair seeing anything."""
    size = seq_local // 2 if zigzag else seq_local
    tasks = []
    for local_q, first_q in _chunks(rank, cp, seq_local, zigzag):
        for local_k, first_k in _chunks(owner, cp, seq_local, zigzag):
            # Rows seeing some key: first_k <= q < last_k + window; keys some row sees:
            # first_q - window < k <= last_q (half-open ranges below).
            q_lo, q_hi = max(first_q, first_k), min(first_q + size, first_k + size - 1 + window)
            k_lo, k_hi = max(first_k, first_q - window + 1), min(first_k + size, first_q + size)
            if q_lo >= q_hi or k_lo >= k_hi:
                continue
            rows = slice(local_q + q_lo - first_q, local_q + q_hi - first_q)
            cols = slice(local_k + k_lo - first_k, local_k + k_hi - first_k)
            if q_lo >= k_hi - 1 and q_hi - 1 - k_lo < window:
                tasks.append(BlockTask(rows, cols, False))
            elif (q_lo, q_hi) == (k_lo, k_hi) and q_hi - 1 - q_lo < window:
                tasks.append(BlockTask(rows, cols, True))
            else:
                tasks.append(BlockTask(rows, cols, False, band=(q_lo, k_lo, window)))
    return tasks


def block_tasks(
    rank: int,
    owner: int,
    seq_local: int,
    cp: int,
    *,
    causal: bool,
    zigzag: bool,
    window: int | None,
) -> list[BlockTask]:
    """The block attention calls of this rank's queries against the K/V block of ``owner``
    (``window`` None, or shorter than the sequence and ``causal``)."""
    if not causal:
        return [BlockTask(_ALL, _ALL, False)]
    if window is None:
        return _causal_plan(rank, owner, seq_local, zigzag=zigzag)
    return _window_plan(rank, owner, seq_local, cp, zigzag=zigzag, window=window)


def ring_steps(
    seq_local: int, cp: int, *, causal: bool, zigzag: bool, window: int | None
) -> list[int]:
    """The ring steps some rank attends at, increasing: step ``s`` is every rank ``r``'s
    block of ``(r - s) % cp``. All ``cp`` without a window; step 0 (the own block) always."""
    if window is None:
        return list(range(cp))
    return [
        step
        for step in range(cp)
        if step == 0
        or any(
            block_tasks(
                rank, (rank - step) % cp, seq_local, cp, causal=causal, zigzag=zigzag, window=window
            )
            for rank in range(cp)
        )
    ]


def band_mask(task: BlockTask, rows: int, cols: int, device: torch.device) -> torch.Tensor | None:
    """The boolean ``[rows, cols]`` mask of ``task`` (True: visible), None without a band."""
    if task.band is None:
        return None
    first_q, first_k, window = task.band
    query = torch.arange(first_q, first_q + rows, device=device).unsqueeze(-1)
    key = torch.arange(first_k, first_k + cols, device=device)
    back = query - key
    return (back >= 0) & (back < window)
