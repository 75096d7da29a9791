"""Which rows of a dim a rank holds under DTensor's ``Shard(dim)``: ``torch.chunk``'s split."""

from __future__ import annotations

__all__ = ["shard_rows"]


def shard_rows(total: int, ranks: int, rank: int) -> tuple[int, int]:
    """``(first, count)`` of rank ``rank``'s rows of a dim of ``total`` rows split over
    ``ranks``: ``ceil(total / ranks)`` a rank, the last ranks' short or empty (DTensor's and
    ``torch.chunk``'s layout). Plain integers, so a traced step sees no tensor offsets.

    Example:
        >>> [shard_rows(5, 4, r) for r in range(4)]
        [(0, 2), (2, 2), (4, 1), (5, 0)]
    """
    chunk = -(-total // ranks)
    first = min(rank * chunk, total)
    return first, min(chunk, total - first)
