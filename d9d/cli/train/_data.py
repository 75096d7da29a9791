"""Which tokens ``d9d train --data`` reads: text, or token ids; never binary as text; the same
on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from ... import data
from ...data._corpus import corpus_files
from ...errors import DataError
from ._resume import say

__all__ = ["training_tokens"]


def training_tokens(path: Path | None, token_dtype: str = "uint16") -> np.ndarray:
    """What the loader reads: text, or a ``.bin`` file of ``token_dtype`` token ids
    (``train.bin`` of a folder holding one, nanoGPT's layout), memory-mapped; a binary file is
    never read as text, and ``token_dtype`` other than uint16 is refused for text. Under
    ``torchrun``, every rank must have read the same tokens (collective)."""
    found = _training_tokens(path)
    if isinstance(found, Path) and found.suffix == ".bin":
        say(f"--data: reading {token_dtype} token ids from {str(found)!r}")
        tokens = data.token_file(found, dtype=np.dtype(token_dtype))
    elif token_dtype != "uint16":
        raise ValueError(
            f"--token-dtype {token_dtype} applies to a .bin token file, but --data is "
            f"{'the standard library corpus' if path is None else repr(str(path))}, read as "
            "text; drop --token-dtype, or pass a .bin file of token ids"
        )
    else:
        tokens = data.stdlib_corpus() if found is None else data.byte_corpus(found)
    _check_same_on_every_rank(tokens, path)
    return tokens


def _check_same_on_every_rank(tokens: np.ndarray, path: Path | None) -> None:
    """Refuse, on every rank, tokens that differ between ranks (by length or
    ``d9d.data.tokens_digest``): each rank cuts its rows from its own stream, so a node
    holding another copy of ``--data`` (or another Python's standard library) fed its ranks
    rows the one-device run never reads, and no row of an epoch was sure to be read once."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    mine = (int(tokens.size), data.tokens_digest(tokens))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, theirs in enumerate(gathered):
        groups.setdefault(tuple(theirs), []).append(rank)
    if len(groups) == 1:
        return
    read = "; ".join(
        f"ranks {ranks}: {size:,} tokens, tokens_digest {digest}"
        for (size, digest), ranks in groups.items()
    )
    if path is None:
        what = "the standard library's sources"
        fix = "run the same Python build on every node, or pass --data on a shared folder"
    else:
        what, fix = f"--data {str(path)!r}", "give every node the same copy (a shared folder)"
    raise DataError(
        f"the ranks read different tokens from {what} ({read}), and each cuts its rows "
        f"from its own: {fix}"
    )


def _training_tokens(path: Path | None) -> Path | None:
    """The path to read (``None``: the standard library), after refusing what is not data."""
    if path is None:
        return None
    if not path.exists():
        raise DataError(
            f"--data {str(path)!r} does not exist; pass a text file, a folder of text files or a .bin token file"
        )
    if path.is_dir():
        if (path / "train.bin").is_file():
            return path / "train.bin"
        token_files = sorted(str(p.relative_to(path)) for p in path.rglob("*.bin"))
        if token_files:
            raise DataError(
                f"--data {str(path)!r} holds token files {token_files[:5]} but no train.bin; "
                "pass one of them as --data, or a folder of text files only"
            )
        binary = [str(p.relative_to(path)) for p in corpus_files(path, None) if _binary(p)]
        if binary:
            raise DataError(
                f"--data {str(path)!r} holds files that are not text (they hold NUL bytes): "
                f"{binary[:5]}; move them out, or pass a folder of text files only"
            )
        return path
    if path.suffix != ".bin" and _binary(path):
        raise DataError(
            f"--data {str(path)!r} is not text (it holds NUL bytes); if it holds token ids, "
            "name it with the .bin suffix; otherwise pass a text file"
        )
    return path


def _binary(path: Path) -> bool:
    with path.open("rb") as file:
        return b"\0" in file.read(8192)
