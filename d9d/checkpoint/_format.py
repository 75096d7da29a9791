"""The on-disk format: step folders, the commit protocol, ``latest`` and ``metadata``.

A directory of checkpoints holds ``step_<N>/`` folders, each complete and committed::

    step_<N>/metadata.json      tree paths, shapes, dtypes, layouts, step, user metadata
    step_<N>/COMMIT             written last, before the rename
    step_<N>/arrays/<path>/     one zarr v3 array per tensor leaf (tensorstore)

A save writes into ``step_<N>.tmp-<nonce>/`` and rank 0 commits it by writing
``COMMIT`` and renaming the folder, which is atomic on POSIX file systems. Readers only
look at ``step_<N>`` folders holding ``COMMIT``; a crash at any point leaves either the
old set of checkpoints or the new one, plus a ``.tmp-`` folder that is ignored (and
removed by the next commit of that step once no live save claims it, by ``keep``'s rotation if
it is rotation trash, or by :func:`sweep`). A committed checkpoint whose ``metadata.json`` does not parse is damaged:
:func:`latest` skips it with a warning and :func:`metadata` raises ``CheckpointCorruptError``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ..errors import CheckpointCorruptError, CheckpointExistsError, CheckpointNotFoundError
from . import _claim
from ._layout import DTYPE_NAMES as _DTYPE_NAMES
from ._layout import dtype_from_name

__all__ = [
    "all_checkpoints",
    "array_file",
    "array_spec",
    "commit",
    "latest",
    "metadata",
    "missing_markers",
    "rotate",
    "step_folders",
    "step_path",
    "sweep",
    "tmp_path",
]

FORMAT = "d9d.checkpoint/1"
METADATA = "metadata.json"
COMMIT = "COMMIT"
_STEP = re.compile(r"^step_(\d+)$")
_TMP = ".tmp-"
_TRASH = f"{_TMP}deleted-"
_KEYS = ("format", "step", "world_size", "leaves", "metadata")
_LEAF_KEYS = {"array": ("shape", "dtype", "chunks", "file"), "value": ("value",)}
# The longest file name (in bytes) of the usual file systems (ext4, xfs, btrfs, APFS).
_NAME_MAX = 255


def step_path(directory: Path, step: int) -> Path:
    """The folder the checkpoint of ``step`` is committed to."""
    return directory / f"step_{step}"


def tmp_path(directory: Path, step: int, nonce: str) -> Path:
    """The folder a save of ``step`` writes into before it commits."""
    return directory / f"step_{step}{_TMP}{nonce}"


def array_file(path: str) -> str:
    """The folder (relative to the checkpoint) of the array of leaf ``path``.

    The path URL-quoted; one longer than a file name may be (255 bytes) is cut and ends
    with a hash of the whole path instead. Restores read the name from the metadata and
    refuse one that is not this (another leaf's folder: values swapped, checksums passing):
    a change of this naming is a change of ``FORMAT``.
    """
    name = quote(path, safe="") or "root"
    if not name.strip("."):  # "." and ".." are not folder names
        name = name.replace(".", "%2E")
    if len(name) > _NAME_MAX:
        digest = hashlib.sha256(path.encode()).hexdigest()[:16]
        name = f"{name[: _NAME_MAX - len(digest) - 1]}~{digest}"
    return f"arrays/{name}"


_CHECKSUM = {"name": "crc32c"}


def _codecs(dtype: str) -> list[dict[str, Any]]:
    """Little-endian bytes, then their CRC32C; a one-byte dtype has no byte order, and
    tensorstore writes its ``bytes`` codec without one, so the spec leaves it out too."""
    if dtype_from_name(dtype).itemsize == 1:
        return [{"name": "bytes"}, _CHECKSUM]
    return [{"name": "bytes", "configuration": {"endian": "little"}}, _CHECKSUM]


def array_spec(root: Path, record: dict[str, Any]) -> dict[str, Any]:
    """The tensorstore spec of an array leaf: zarr v3, a CRC32C checksum in every chunk.

    Every chunk is stored, even one equal to the fill value (all zeros): zarr would skip
    it, and a restore, which treats a missing chunk as damage, could not tell it was never
    written.
    """
    return {
        "driver": "zarr3",
        "store_data_equal_to_fill_value": True,
        "kvstore": {"driver": "file", "path": str(root / record["file"])},
        "metadata": {
            "shape": record["shape"],
            "data_type": record["dtype"],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": record["chunks"]}},
            "codecs": _codecs(record["dtype"]),
        },
    }


def step_folders(directory: Path) -> list[tuple[int, Path]]:
    """Every ``step_<N>`` entry of ``directory`` with its step, committed or not, by step."""
    found = []
    if directory.is_dir():
        for entry in directory.iterdir():
            match = _STEP.match(entry.name)
            if match:
                found.append((int(match.group(1)), entry))
    return sorted(found)


def missing_markers(path: Path) -> list[str]:
    """The commit's files (``COMMIT``, ``metadata.json``) that ``path`` lacks."""
    return [name for name in (COMMIT, METADATA) if not (path / name).is_file()]


def _committed(directory: Path) -> list[tuple[int, Path]]:
    return [(step, path) for step, path in step_folders(directory) if not missing_markers(path)]


def all_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Every committed checkpoint in ``directory``, oldest step first.

    Committed means a ``step_<N>`` folder holding ``COMMIT`` and ``metadata.json``; whether
    its metadata parses and its arrays are intact is not checked here.

    Args:
        directory: A folder that :func:`save` wrote checkpoints into; it need not exist.

    Returns:
        The checkpoint folders, sorted by step.

    Example:
        >>> import tempfile
        >>> all_checkpoints(tempfile.mkdtemp())
        []
    """
    return [path for _, path in _committed(Path(directory))]


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in ``directory``, or ``None`` if it holds none.

    Only committed ``step_<N>`` folders count: folders still being written
    (``step_<N>.tmp-*``), left by a crash, or lacking their ``COMMIT`` marker are ignored.
    A committed one whose ``metadata.json`` does not parse is skipped with a warning, so a
    damaged newest checkpoint never hides the older ones.

    Args:
        directory: A folder that :func:`save` wrote checkpoints into; it need not exist.

    Returns:
        The path of the readable committed checkpoint with the highest step, or ``None``.

    Example:
        >>> import tempfile
        >>> latest(tempfile.mkdtemp()) is None
        True
    """
    for path in reversed(all_checkpoints(directory)):
        try:
            metadata(path)
        except CheckpointCorruptError as error:
            warnings.warn(f"{error}; skipped", stacklevel=2)
            continue
        return path
    return None


def metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of the checkpoint at ``path``, as parsed from its ``metadata.json``.

    Keys: ``format``, ``step``, ``world_size``, ``leaves`` (per leaf path: ``kind``
    ``"array"`` with ``shape``, ``dtype``, ``chunks``, ``file`` and the ``mesh`` and
    ``placements`` that wrote it, or ``kind`` ``"value"`` with the Python ``value``),
    ``metadata`` (what was passed to ``save``) and ``checksum`` (how arrays are checked).

    Args:
        path: A checkpoint folder, e.g. from :func:`latest`.

    Returns:
        The metadata dict.

    Raises:
        CheckpointNotFoundError: ``path`` is not a committed checkpoint, or of another format.
        CheckpointCorruptError: ``metadata.json`` is not valid JSON, lacks a field or holds
            one of a value no save writes; the message names the file.

    Example:
        >>> import tempfile, torch
        >>> from d9d.checkpoint import save
        >>> path = save(tempfile.mkdtemp(), {"w": torch.ones(2)}, step=3).wait()
        >>> metadata(path)["step"], metadata(path)["leaves"]["w"]["shape"]
        (3, [2])
    """
    path = Path(path)
    if not (path / COMMIT).is_file() or not (path / METADATA).is_file():
        steps = [p.name for _, p in _committed(path)]
        hint = (
            f" It holds the checkpoints {steps}: pass one of them, or latest({str(path)!r})."
            if steps
            else " Pass a committed step_<N> folder, e.g. from d9d.checkpoint.latest(directory)."
        )
        raise CheckpointNotFoundError(
            f"{str(path)!r} is not a complete checkpoint (no {COMMIT} and {METADATA} in it)." + hint
        )
    file = path / METADATA
    try:
        meta = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointCorruptError(
            f"{str(file)!r} is not valid JSON ({error}); the checkpoint is damaged: restore an "
            "older one"
        ) from None
    if isinstance(meta, dict) and "format" in meta and meta["format"] != FORMAT:
        raise CheckpointNotFoundError(
            f"{str(path)!r} holds format {meta.get('format')!r}, this d9d reads {FORMAT!r}."
        )
    problem = _malformed(meta)
    if problem:
        raise CheckpointCorruptError(
            f"{str(file)!r} is not a d9d checkpoint's metadata: {problem}; the checkpoint is "
            "damaged: restore an older one"
        )
    return meta


def _malformed(meta: Any) -> str | None:
    """What is missing from parsed metadata, or ``None``."""
    if not isinstance(meta, dict):
        return f"a {type(meta).__name__}, missing every field {list(_KEYS)}"
    missing = [key for key in _KEYS if key not in meta]
    if missing:
        return f"missing {missing}"
    if not isinstance(meta["step"], int) or not isinstance(meta["leaves"], dict):
        return f"step {meta['step']!r} or leaves of type {type(meta['leaves']).__name__}"
    for leaf, record in meta["leaves"].items():
        kind = record.get("kind") if isinstance(record, dict) else None
        if kind not in _LEAF_KEYS:
            return f"leaf {leaf!r} has kind {kind!r}, not 'array' or 'value'"
        missing = [key for key in _LEAF_KEYS[kind] if key not in record]
        if missing:
            return f"leaf {leaf!r} is missing {missing}"
        wrong = _wrong_field(record)
        if wrong:
            return f"leaf {leaf!r} has {wrong}"
        if kind == "array" and record["file"] != array_file(leaf):  # another leaf's, or outside
            return f"leaf {leaf!r} has file={record['file']!r}, not its own {array_file(leaf)!r}"
    return None


def _ints(value: Any, least: int) -> bool:
    return isinstance(value, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= least for n in value
    )


def _wrong_field(record: dict[str, Any]) -> str | None:
    """The first field of a leaf's record whose value no save writes, as ``name=value``."""
    if record["kind"] == "value":
        ok = isinstance(record["value"], bool | int | float | str)
        return None if ok else f"value={record['value']!r}"
    if not _ints(record["shape"], 0):
        return f"shape={record['shape']!r}"
    if not isinstance(record["dtype"], str) or record["dtype"] not in _DTYPE_NAMES:
        return f"dtype={record['dtype']!r}"
    if not _ints(record["chunks"], 1) or len(record["chunks"]) != len(record["shape"]):
        return f"chunks={record['chunks']!r}"
    if not isinstance(record["file"], str):
        return f"file={record['file']!r}"
    return None


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Write the metadata and commit marker into ``tmp``, then rename it to ``final``."""
    _write_synced(tmp / METADATA, json.dumps(meta, indent=1) + "\n")
    _write_synced(tmp / COMMIT, json.dumps({"step": meta["step"]}) + "\n")
    _sync_dir(tmp)
    try:
        if final.exists():  # another save of this step committed first
            raise FileExistsError(errno.EEXIST, "exists", str(final))
        os.rename(tmp, final)  # fails if `final` exists: a commit never replaces a checkpoint
    except OSError as error:
        # A save that commits between the check and the rename makes the rename fail:
        # ENOTEMPTY on Linux for a directory onto a non-empty one (seen in CI), else EEXIST.
        if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        raise CheckpointExistsError(
            f"{str(final)!r} is already committed by another save"
        ) from None
    _sync_dir(final.parent)


def rotate(directory: Path, step: int, keep: int | None) -> None:
    """After committing ``step``: drop leftovers of crashed saves of ``step``, the trash of
    an interrupted earlier rotation, and all but the newest ``keep`` checkpoints, of those
    older than ``step`` only.

    A leftover is a ``step_<step>.tmp-`` folder that no live save claims (``_claim.py``):
    another save of ``step`` may be writing into its own. A checkpoint is first renamed to a
    ``.tmp-deleted-`` name, so a crash mid-delete never leaves a half-deleted folder that
    looks complete.
    """
    for path in directory.glob(f"step_{step}{_TMP}*"):
        held = _claim.abandoned(path)
        if held is not None:
            shutil.rmtree(path, ignore_errors=True)
            held.release()
    doomed = [p for p in directory.glob(f"step_*{_TRASH}*") if p.is_dir()]
    if keep is not None:
        committed = _committed(directory)
        # The oldest past ``keep``, but never the one just made nor a later step's (a save
        # that committed first, or a later run's): those stay, more than ``keep`` then.
        oldest = committed[: max(0, len(committed) - keep)]
        for path in [path for s, path in oldest if s < step]:
            trash = path.with_name(f"{path.name}{_TRASH}{secrets.token_hex(4)}")
            try:
                os.rename(path, trash)
            except FileNotFoundError:  # the rotation of a concurrent save took it first
                continue
            doomed.append(trash)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)


def sweep(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete every unfinished save (``step_<N>.tmp-*`` folder) in ``directory`` but those a
    live save holds (``_claim.py``).

    Call it when no save into ``directory`` should be in flight (e.g. when a run starts):
    ``d9d train`` does, on rank 0. A save still writing on this machine (the run being
    replaced, committing its last checkpoint) keeps its folder; where folders cannot be
    locked (NFS, Lustre without ``flock``) no save can be told from a dead one's leftovers,
    and every such folder is deleted.

    Args:
        directory: A folder of checkpoints; it need not exist.

    Returns:
        The folders removed.

    Example:
        >>> import tempfile
        >>> sweep(tempfile.mkdtemp())
        []
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for path in sorted(p for p in directory.glob(f"step_*{_TMP}*") if p.is_dir()):
        claim = _claim.abandoned(path, unlockable=True)
        if claim is None:  # a live save's (or gone)
            continue
        shutil.rmtree(path, ignore_errors=True)  # holding its lock: no save claims it meanwhile
        claim.release()
        removed.append(path)
    return removed
