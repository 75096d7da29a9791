"""Which tokens ``d9d train --data`` reads: text, or token ids; never binary as text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ... import data
from ...data._corpus import corpus_files
from ...errors import DataError
from ._resume import say

__all__ = ["training_tokens"]


def training_tokens(path: Path | None, token_dtype: str = "uint16") -> Any:
    """What the loader reads: text, or a ``.bin`` file of ``token_dtype`` token ids
    (``train.bin`` of a folder holding one, nanoGPT's layout), memory-mapped; a binary file is
    never read as text, and ``token_dtype`` other than uint16 is refused for text."""
    tokens = _training_tokens(path)
    if isinstance(tokens, Path) and tokens.suffix == ".bin":
        say(f"--data: reading {token_dtype} token ids from {str(tokens)!r}")
        return data.token_file(tokens, dtype=np.dtype(token_dtype))
    if token_dtype != "uint16":
        raise ValueError(
            f"--token-dtype {token_dtype} applies to a .bin token file, but --data is "
            f"{'the standard library corpus' if path is None else repr(str(path))}, read as "
            "text; drop --token-dtype, or pass a .bin file of token ids"
        )
    return tokens


def _training_tokens(path: Path | None) -> Any:
    if path is None:
        return data.stdlib_corpus()
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
