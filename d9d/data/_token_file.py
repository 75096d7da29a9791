"""Pre-tokenized datasets: a flat binary file of token ids, memory-mapped (nanoGPT's ``.bin``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from numpy.typing import DTypeLike

from d9d.errors import DataError

__all__ = ["token_file"]


def token_file(path: str | os.PathLike[str], *, dtype: DTypeLike = np.uint16) -> np.memmap:
    """Memory-maps a file of raw token ids, read-only, without reading it.

    The file is the tokens of a whole dataset written back to back with no header, as
    ``np.array(ids, dtype=np.uint16).tofile(path)`` writes them (nanoGPT's ``train.bin``).
    Pages are read only when a batch touches them, so the file may exceed memory. Document
    separators are whatever the tokenizer put there (an end-of-text id); the vocab size is the
    caller's business.

    Args:
        path: the token file.
        dtype: the integer dtype the ids were written in. Default ``np.uint16`` (vocabularies
            up to 65,536 ids); use ``np.uint32`` for larger ones.

    Returns:
        A read-only 1-D ``np.memmap`` of the tokens.

    Raises:
        DataError: the file does not exist, is not a file, is empty, or its size is not a
            multiple of the dtype's size.
        ValueError: ``dtype`` is not an integer dtype.

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "train.bin"
        >>> np.array([5, 300, 65535], dtype=np.uint16).tofile(path)
        >>> token_file(path).tolist()
        [5, 300, 65535]
    """
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        raise ValueError(f"token ids must have an integer dtype, got {dtype=}; e.g. np.uint16")
    path = Path(path)
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise DataError(f"token file {str(path)!r} {what}; pass a file of raw {dtype} token ids")
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"token file {str(path)!r} is empty; it must hold at least one token")
    if size % dtype.itemsize:
        raise DataError(
            f"token file {str(path)!r} has {size} bytes, not a multiple of {dtype.itemsize} "
            f"({dtype}): pass the dtype it was written with (dtype=np.uint32?)"
        )
    return np.memmap(path, dtype=dtype, mode="r")
