"""Reading a box of a checkpoint array straight from its zarr v3 chunk files.

Every array a save writes has one codec chain: raw little-endian C-order bytes, then their
CRC32C (``_format.array_spec``). A chunk file is therefore the chunk's bytes and 4 bytes of
checksum, at ``c/<i>/<j>/...`` (``c`` alone for a 0-d array), padded to the full chunk
shape at the array's edges. A chunk that lies whole and contiguous in the box is read
straight into the output (one copy from the page cache) and its checksum computed there;
others go through one reused scratch buffer. tensorstore, which writes the arrays, spent
most of its reads in its CRC32C (about 0.26 GB/s here) and a decode copy: restoring the
310 MB state of ``benchmarks/checkpoint.py`` took 0.45 s with it, against DCP's 0.22 s,
and now takes about 0.7x DCP's time (``docs/checkpoint.md``, "Performance").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import product
from pathlib import Path
from typing import Any

import torch

from . import _format

__all__ = ["check_array", "read_box"]

_CHECKSUM_BYTES = 4


def check_array(root: Path, record: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless the array's ``zarr.json`` is the one its record implies."""
    spec = _format.array_spec(root, record)
    path = Path(spec["kvstore"]["path"]) / "zarr.json"
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{str(path)!r} is missing") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{str(path)!r} cannot be read: {exc}") from None
    wanted = spec["metadata"]
    for key in ("shape", "data_type", "chunk_grid", "codecs"):
        if stored.get(key) != wanted[key]:
            raise ValueError(
                f"{str(path)!r} has {key}={stored.get(key)!r}, the checkpoint's metadata "
                f"{wanted[key]!r}"
            )
    encoding = stored.get("chunk_key_encoding", {"name": "default"})
    if (
        encoding.get("name") != "default"
        or encoding.get("configuration", {}).get("separator", "/") != "/"
    ):
        raise ValueError(f"{str(path)!r} has chunk_key_encoding={encoding!r}, not 'default'")


def _read_chunk(file: Path, into: torch.Tensor) -> None:
    """Fill ``into`` (contiguous bytes) with the chunk at ``file``; raise unless its size and
    checksum are right."""
    import google_crc32c

    data = into.view(-1).view(torch.uint8).numpy()
    try:
        with open(file, "rb", buffering=0) as handle:
            filled = 0
            while filled < data.nbytes and (n := handle.readinto(memoryview(data)[filled:])):
                filled += n
            tail = handle.read(_CHECKSUM_BYTES + 1)
    except FileNotFoundError:
        raise ValueError(f"chunk {file.name!r} ({str(file)!r}) is missing") from None
    except OSError as exc:
        raise ValueError(f"chunk {str(file)!r} cannot be read: {exc}") from None
    if filled != data.nbytes or len(tail) != _CHECKSUM_BYTES:
        raise ValueError(
            f"chunk {str(file)!r} holds {filled + len(tail)} bytes, not "
            f"{data.nbytes + _CHECKSUM_BYTES}: it is truncated or overwritten"
        )
    computed = google_crc32c.extend(0, data)
    if computed != int.from_bytes(tail, "little"):
        raise ValueError(
            f"Digest mismatch in chunk {str(file)!r}: stored crc32c "
            f"{int.from_bytes(tail, 'little'):#010x}, computed {computed:#010x}"
        )


def _contiguous(lo: Sequence[int], hi: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether the region ``[lo, hi)`` of a C-contiguous array of ``shape`` is one run."""
    dims = [h - low for low, h in zip(lo, hi, strict=True)]
    inner = len(dims)
    while inner > 0 and dims[inner - 1] == shape[inner - 1]:
        inner -= 1
    return all(n == 1 for n in dims[: max(inner - 1, 0)])


def read_box(
    root: Path,
    record: dict[str, Any],
    box: tuple[tuple[int, ...], tuple[int, ...]],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The box ``(offset, shape)`` of the array ``record`` describes, as a new CPU tensor.

    Raises:
        ValueError: A chunk is missing, truncated, or fails its checksum.
    """
    offset, shape = box
    chunks, size = tuple(record["chunks"]), tuple(record["shape"])
    out = torch.empty(shape, dtype=dtype)
    folder = Path(_format.array_spec(root, record)["kvstore"]["path"]) / "c"
    if not shape:
        _read_chunk(folder, out)
        return out
    grid = [range(o // c, -(-(o + n) // c)) for o, n, c in zip(offset, shape, chunks, strict=True)]
    scratch = None
    for index in product(*grid):
        start = [i * c for i, c in zip(index, chunks, strict=True)]
        lo = [max(s, o) for s, o in zip(start, offset, strict=True)]
        hi = [
            min(s + c, o + n, g)
            for s, c, o, n, g in zip(start, chunks, offset, shape, size, strict=True)
        ]
        local = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))
        file = folder.joinpath(*map(str, index))
        whole = all(b - a == c for a, b, c in zip(lo, hi, chunks, strict=True))
        target = out[local]
        if whole and _contiguous([s.start for s in local], [s.stop for s in local], shape):
            _read_chunk(file, target)
            continue
        if scratch is None:
            scratch = torch.empty(chunks, dtype=dtype)
        _read_chunk(file, scratch)
        inside = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start, strict=True))
        target.copy_(scratch[inside])
    return out
