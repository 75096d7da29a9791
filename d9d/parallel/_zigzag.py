"""Splitting a sequence across the ``cp`` ranks: contiguous chunks or the zigzag layout.

Under causal attention a query attends only to earlier keys, so with contiguous chunks the
last rank does ``cp`` blocks of work and the first one block. The zigzag layout cuts the
sequence into ``2 * cp`` chunks and gives rank ``r`` chunks ``r`` and ``2 * cp - 1 - r``: one
early and one late chunk each, so every rank does the same causal work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from d9d.errors import IndivisibleError

__all__ = [
    "LoadBalance",
    "check_load_balance",
    "positions_for",
    "shard_sequence",
    "unshard_sequence",
    "zigzag_shard",
    "zigzag_unshard",
]

LoadBalance = Literal["zigzag"] | None


def check_load_balance(load_balance: object) -> None:
    """Raise ``ValueError`` unless ``load_balance`` is ``"zigzag"`` or ``None``."""
    if load_balance not in ("zigzag", None):
        raise ValueError(
            f"{load_balance=} is not a load balancing scheme: use 'zigzag' (equal causal work "
            "per rank) or None (contiguous chunks)."
        )


def _check_split(seq_len: int, rank: int, cp: int, load_balance: LoadBalance) -> None:
    check_load_balance(load_balance)
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"{cp=} must be an int >= 1 (the size of the cp mesh axis).")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < cp:
        raise ValueError(f"{rank=} must be an int in [0, {cp}) (this rank's cp coordinate).")
    chunks = 2 * cp if load_balance == "zigzag" else cp
    if seq_len % chunks:
        what = "2 * cp" if load_balance == "zigzag" else "cp"
        raise IndivisibleError(
            f"sequence length {seq_len} is not divisible by {what} = {chunks} "
            f"(load_balance={load_balance!r}, cp={cp}): pad or pack sequences to a multiple "
            f"of {chunks}."
        )


def positions_for(
    rank: int, cp: int, seq_len: int, *, load_balance: LoadBalance = "zigzag"
) -> torch.Tensor:
    """The global token positions that cp rank ``rank`` holds, in its local order.

    Use them for RoPE (and any position-dependent op) on the rank's shard of the sequence.

    Args:
        rank: This rank's coordinate on the ``cp`` mesh axis, in ``[0, cp)``.
        cp: Size of the ``cp`` mesh axis.
        seq_len: Global sequence length.
        load_balance: ``"zigzag"`` (default) or ``None`` for contiguous chunks.

    Returns:
        An int64 tensor of ``seq_len // cp`` positions.

    Raises:
        IndivisibleError: ``seq_len`` is not divisible by ``2 * cp`` (zigzag) or ``cp``.
        ValueError: ``rank``, ``cp`` or ``load_balance`` is invalid.

    Example:
        >>> positions_for(0, 2, 8).tolist()
        [0, 1, 6, 7]
    """
    _check_split(seq_len, rank, cp, load_balance)
    return shard_sequence(torch.arange(seq_len), 0, rank, cp, load_balance=load_balance)


def _check_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"{dim=} is out of range for a tensor of shape {tuple(x.shape)}.")
    return dim % x.ndim


def shard_sequence(
    x: torch.Tensor, dim: int, rank: int, cp: int, *, load_balance: LoadBalance = "zigzag"
) -> torch.Tensor:
    """This cp rank's shard of the sequence dimension ``dim`` of ``x``.

    Args:
        x: The full sequence, e.g. tokens ``[B, S]`` or activations ``[B, S, E]``.
        dim: The sequence dimension.
        rank: This rank's coordinate on the ``cp`` mesh axis.
        cp: Size of the ``cp`` mesh axis.
        load_balance: ``"zigzag"`` (default: chunks ``rank`` and ``2 * cp - 1 - rank`` of
            ``2 * cp``) or ``None`` (chunk ``rank`` of ``cp``).

    Returns:
        A new tensor with ``x.shape[dim] // cp`` entries along ``dim``.

    Raises:
        IndivisibleError: ``x.shape[dim]`` is not divisible by ``2 * cp`` (zigzag) or ``cp``.
        ValueError: ``dim``, ``rank``, ``cp`` or ``load_balance`` is invalid.

    Example:
        >>> shard_sequence(torch.arange(8), 0, 1, 2, load_balance=None).tolist()
        [4, 5, 6, 7]
    """
    dim = _check_dim(x, dim)
    _check_split(x.shape[dim], rank, cp, load_balance)
    if load_balance is None:
        return x.chunk(cp, dim)[rank].clone()
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def unshard_sequence(
    shards: Sequence[torch.Tensor], dim: int, *, load_balance: LoadBalance = "zigzag"
) -> torch.Tensor:
    """Reassemble the full sequence from every cp rank's shard (the inverse of
    :func:`shard_sequence`).

    Args:
        shards: One shard per cp rank, in rank order, all of one shape.
        dim: The sequence dimension.
        load_balance: The layout the shards were cut with: ``"zigzag"`` (default) or ``None``.

    Returns:
        A new tensor with ``len(shards) * shards[0].shape[dim]`` entries along ``dim``.

    Raises:
        IndivisibleError: zigzag shards have an odd length along ``dim``.
        ValueError: ``shards`` is empty or its shapes differ, or ``dim`` or
            ``load_balance`` is invalid.

    Example:
        >>> parts = [shard_sequence(torch.arange(8), 0, r, 2) for r in range(2)]
        >>> unshard_sequence(parts, 0).tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
    """
    check_load_balance(load_balance)
    if not shards:
        raise ValueError("shards is empty: pass one shard per cp rank, in rank order.")
    shapes = [tuple(s.shape) for s in shards]
    if len(set(shapes)) != 1:
        raise ValueError(f"shards must all have one shape, got {shapes=}.")
    dim = _check_dim(shards[0], dim)
    if load_balance is None:
        return torch.cat(list(shards), dim)
    if shards[0].shape[dim] % 2:
        raise IndivisibleError(
            f"zigzag shards hold two equal chunks, but their length along {dim=} is "
            f"{shards[0].shape[dim]} (odd): pass shards cut by zigzag_shard."
        )
    halves = [s.chunk(2, dim) for s in shards]
    early = [first for first, _ in halves]
    late = [second for _, second in reversed(halves)]
    return torch.cat(early + late, dim)


def zigzag_shard(x: torch.Tensor, dim: int, rank: int, cp: int) -> torch.Tensor:
    """This cp rank's zigzag shard of ``x`` along ``dim``: chunks ``rank`` and
    ``2 * cp - 1 - rank`` of ``2 * cp`` equal chunks, concatenated.

    Same as ``shard_sequence(x, dim, rank, cp, load_balance="zigzag")``.

    Example:
        >>> zigzag_shard(torch.arange(8), 0, 1, 2).tolist()
        [2, 3, 4, 5]
    """
    return shard_sequence(x, dim, rank, cp, load_balance="zigzag")


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The full sequence from every rank's zigzag shard, in rank order (inverse of
    :func:`zigzag_shard`).

    Same as ``unshard_sequence(shards, dim, load_balance="zigzag")``.

    Example:
        >>> zigzag_unshard([torch.tensor([0, 3]), torch.tensor([1, 2])], 0).tolist()
        [0, 1, 2, 3]
    """
    return unshard_sequence(shards, dim, load_balance="zigzag")
