"""Packing a token stream into fixed-length training windows, and their order per epoch.

Window ``w`` is ``stream[w * seq_len : w * seq_len + seq_len + 1]``: its first ``seq_len``
tokens are the inputs and its last ``seq_len`` the labels (next tokens). Consecutive windows
share their boundary token, so inputs never overlap and, per epoch, every token after the
first is a label exactly once; the tail shorter than a window is never used. Windows run
across document separators: the model sees where a document ends and the next begins.
"""

from __future__ import annotations

import numpy as np

__all__ = ["epoch_permutation", "gather_windows", "num_windows"]

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def num_windows(num_tokens: int, seq_len: int) -> int:
    """How many ``seq_len + 1``-token windows a stream of ``num_tokens`` tokens packs into.

    Windows start every ``seq_len`` tokens and share their boundary token, so this is
    ``(num_tokens - 1) // seq_len``: the sequences one epoch holds.

    Args:
        num_tokens: length of the token stream.
        seq_len: tokens per training sequence (inputs; the window adds one label token).

    Returns:
        The window count, 0 when not even one window fits.

    Example:
        >>> num_windows(9, seq_len=4), num_windows(8, seq_len=4)
        (2, 1)
    """
    return max(num_tokens - 1, 0) // seq_len


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 (Steele et al., OOPSLA 2014) on a uint64 array; wraps modulo 2**64."""
    x = x + _GOLDEN_GAMMA
    x = (x ^ (x >> np.uint64(30))) * _MIX_1
    x = (x ^ (x >> np.uint64(27))) * _MIX_2
    return x ^ (x >> np.uint64(31))


def epoch_permutation(count: int, *, seed: int, epoch: int) -> np.ndarray:
    """The order in which one epoch visits windows ``0..count-1``: a pure function of its args.

    Each window gets a 64-bit key from SplitMix64 of (seed, epoch, window) and windows are
    sorted by key (stable sort, ties by index). Only exact integer arithmetic is involved, so
    the order is the same on every machine and every NumPy version, unlike
    ``np.random.Generator.permutation`` or ``torch.randperm``, whose streams may change between
    releases.

    Args:
        count: number of windows.
        seed: the run's data seed, in ``[0, 2**64)``.
        epoch: the epoch, from 0.

    Returns:
        A 1-D ``np.int64`` array holding each of ``0..count-1`` once.

    Example:
        >>> sorted(epoch_permutation(5, seed=0, epoch=0).tolist())
        [0, 1, 2, 3, 4]
    """
    with np.errstate(over="ignore"):
        state = _splitmix64(np.array([seed], dtype=np.uint64))
        state = _splitmix64(state ^ np.array([epoch], dtype=np.uint64))
        keys = _splitmix64(state ^ np.arange(count, dtype=np.uint64))
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


def gather_windows(tokens: np.ndarray, windows: np.ndarray, seq_len: int) -> np.ndarray:
    """Rows ``tokens[w * seq_len : w * seq_len + seq_len + 1]`` for each ``w`` in ``windows``.

    Args:
        tokens: the 1-D token stream (an array or a memmap; only the rows are read).
        windows: 1-D window indices, each below ``num_windows(len(tokens), seq_len)``.
        seq_len: tokens per training sequence.

    Returns:
        A ``(len(windows), seq_len + 1)`` array of ``tokens.dtype``.

    Example:
        >>> gather_windows(np.arange(7), np.array([2, 0]), seq_len=2).tolist()
        [[4, 5, 6], [0, 1, 2]]
    """
    offsets = np.arange(seq_len + 1, dtype=np.int64)
    return tokens[windows[:, None] * seq_len + offsets]
