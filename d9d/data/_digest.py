"""A token stream's digest: what a loader's saved position checks the data by on resume."""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["SAMPLED_TOKENS", "tokens_digest"]

# Tokens read for the digest: enough that two corpora of one length (another file, another
# Python's standard library) differ in it, few enough to cost nothing on a memory-mapped file
# of billions of tokens (one page per sample).
SAMPLED_TOKENS = 4096


def tokens_digest(tokens: np.ndarray) -> int:
    """A 63-bit digest of ``tokens``: its length and ``SAMPLED_TOKENS`` ids spread evenly
    over it (all of them when fewer), first and last included, read as int64 so that the
    same ids in another integer dtype give the same digest.

    A stream of another length, or with other ids at a sampled position, gets another digest;
    an edit that changes no sampled id (a few tokens in a long stream) may keep it.

    Args:
        tokens: a 1-D integer array or memmap.

    Returns:
        An int in ``[0, 2**63)``, the same on every machine (JSON-safe as an int64).

    Example:
        >>> tokens_digest(np.arange(10, dtype=np.uint16)) == tokens_digest(np.arange(10))
        True
        >>> tokens_digest(np.arange(10)) == tokens_digest(np.arange(1, 11))
        False
    """
    size = int(tokens.size)
    count = min(size, SAMPLED_TOKENS)
    positions = np.arange(count, dtype=np.int64) * (size - 1) // max(count - 1, 1)
    sampled = np.asarray(tokens[positions], dtype="<i8")
    digest = hashlib.blake2b(digest_size=8)
    digest.update(size.to_bytes(8, "little"))
    digest.update(sampled.tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1
