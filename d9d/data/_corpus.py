"""Byte-level corpora: local text files read as one stream of byte tokens.

A byte corpus is a read-only 1-D ``np.uint8`` array: every byte of every document is one
token (vocab ``BYTE_VOCAB_SIZE == 256``) and documents are separated by token 0 (NUL), a
byte that text files do not contain; any NUL a file does contain is dropped, so token 0
means "document boundary" and nothing else. A document is one file.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from d9d.errors import DataError

__all__ = ["BYTE_VOCAB_SIZE", "byte_corpus", "stdlib_corpus"]

BYTE_VOCAB_SIZE = 256
_SEPARATOR = b"\0"
# Directories left out of the standard-library corpus: installed packages and test suites
# differ between installs of one Python version; the rest of the stdlib does not.
_STDLIB_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
_ACCEPTED = "a text file, a directory of text files, or a list of those"


def _sort_key(root: Path, path: Path) -> tuple[str, ...]:
    # Path components, not the joined string: the order is the same on every OS.
    return path.relative_to(root).parts


def corpus_files(root: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    """The files under ``root`` that ``byte_corpus`` reads (those ending in one of
    ``suffixes``, or all with ``None``), hidden files and folders and ``__pycache__`` left
    out, in a path order that is the same on every OS."""
    found = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            if name.startswith("."):
                continue
            if suffixes is not None and not name.endswith(suffixes):
                continue
            found.append(Path(directory, name))
    return sorted(found, key=lambda path: _sort_key(root, path))


def _read_documents(files: Iterable[Path], max_bytes: int | None) -> tuple[bytearray, int]:
    """Appends each non-empty file, NULs removed, to one buffer; returns it and the file count."""
    stream = bytearray()
    count = 0
    for path in files:
        if max_bytes is not None and len(stream) >= max_bytes:
            break
        document = path.read_bytes().replace(_SEPARATOR, b"")
        if not document:
            continue
        if stream:
            stream += _SEPARATOR
        stream += document
        count += 1
    return stream, count


def _as_array(stream: bytearray, max_bytes: int | None) -> np.ndarray:
    tokens = np.frombuffer(stream, dtype=np.uint8)[:max_bytes]
    tokens.flags.writeable = False
    return tokens


def _check_max_bytes(max_bytes: int | None) -> None:
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"max_bytes must be a positive int or None (no cap), got {max_bytes=}")


def byte_corpus(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    suffixes: Sequence[str] | None = None,
    max_bytes: int | None = None,
) -> np.ndarray:
    """Reads local text files into one stream of byte tokens, documents separated by 0.

    Paths are read in the order given; a directory contributes every file under it
    (recursively, hidden entries and ``__pycache__`` skipped) in sorted path order, so the
    stream is the same on every machine holding the same files. Each file is one document;
    NUL bytes inside a file are removed and documents are joined with a single 0 token.
    Empty files inside a directory are skipped.

    Args:
        paths: a file, a directory, or a sequence of files and directories.
        suffixes: keep only directory entries whose names end with one of these (e.g.
            ``(".py", ".md")``); files named directly are always read. Default: every file.
        max_bytes: cap on the stream length in tokens (bytes): files are read in order until
            the cap is reached and the stream is cut there. Default: no cap.

    Returns:
        A read-only 1-D ``np.uint8`` array of tokens in ``0..255``.

    Raises:
        DataError: a path does not exist, a directory holds no (matching, non-empty) file, or
            a named file is empty.
        ValueError: ``max_bytes`` is not a positive int.

    Example:
        >>> import pathlib, tempfile
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (root / "b.txt").write_text("yo")
        >>> _ = (root / "a.txt").write_text("hi")
        >>> byte_corpus(root).tolist()
        [104, 105, 0, 121, 111]
    """
    _check_max_bytes(max_bytes)
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    if not paths:
        raise DataError(f"byte_corpus got no paths ({paths=}); pass {_ACCEPTED}")
    suffixes = None if suffixes is None else tuple(suffixes)
    for path in map(Path, paths):
        if not path.exists():
            raise DataError(f"data path {str(path)!r} does not exist; pass {_ACCEPTED}")
    stream = bytearray()
    for path in map(Path, paths):
        remaining = None if max_bytes is None else max_bytes - len(stream)
        if remaining is not None and remaining <= 0:
            break
        files = corpus_files(path, suffixes) if path.is_dir() else [path]
        documents, count = _read_documents(files, remaining)
        if count == 0:
            what = f"files ending with {suffixes}" if suffixes else "non-empty files"
            detail = f"holds no {what}" if path.is_dir() else "is empty"
            raise DataError(f"data path {str(path)!r} {detail}; pass {_ACCEPTED}")
        if stream:
            stream += _SEPARATOR
        stream += documents
    return _as_array(stream, max_bytes)


def _stdlib_files(root: Path) -> list[Path]:
    found = []
    for directory, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if d not in _STDLIB_SKIPPED_DIRS and not d.startswith("config-")
        ]
        # _sysconfigdata_*.py records the build machine's paths and flags.
        found.extend(
            Path(directory, name)
            for name in filenames
            if name.endswith(".py") and not name.startswith("_sysconfigdata")
        )
    return sorted(found, key=lambda path: _sort_key(root, path))


def stdlib_corpus(*, max_bytes: int | None = 16 * 2**20) -> np.ndarray:
    """The running Python's standard-library sources as a byte corpus: data that is always there.

    Reads every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` in sorted path order,
    leaving out installed packages (``site-packages``), test suites and build-specific files,
    so one Python version gives the same stream on every install. About 12 MB for CPython
    3.11; reading it takes about 0.2 s.

    Args:
        max_bytes: cap on the stream length in tokens (bytes). Default 16 MiB.

    Returns:
        A read-only 1-D ``np.uint8`` array, laid out as by ``byte_corpus``.

    Raises:
        DataError: no standard-library source was found (a Python installed without its
            ``.py`` files).
        ValueError: ``max_bytes`` is not a positive int.

    Example:
        >>> tokens = stdlib_corpus(max_bytes=1000)
        >>> tokens.shape, tokens.dtype
        ((1000,), dtype('uint8'))
    """
    _check_max_bytes(max_bytes)
    root = Path(sysconfig.get_paths()["stdlib"])
    stream, count = _read_documents(_stdlib_files(root), max_bytes)
    if count == 0:
        raise DataError(
            f"no standard-library sources (*.py) under {str(root)!r}; this Python was installed "
            "without them: pass your own text files to byte_corpus instead"
        )
    return _as_array(stream, max_bytes)
