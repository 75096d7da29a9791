"""``save``: each rank writes the shards it owns in the background; rank 0 commits.

The call itself is short and collective: it checks the tree, agrees with the other ranks
on what the checkpoint holds (one ``all_gather_object`` of leaf descriptions), and copies
the shards this rank writes to host memory, so the caller may update its tensors in place
as soon as it returns. A background thread then writes the copies with tensorstore and
takes part in the commit (``_commit.py``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import tree as tree_lib
from ..core._donation import check_not_donated
from ..errors import CheckpointExistsError
from . import _claim, _format
from ._commit import SaveHandle, Write, WriteJob, post_failure
from ._host_memory import host_empty
from ._layout import brief, chunk_shape, dtype_name, layout_of, local_box, writes_box

__all__ = ["SaveHandle", "save"]

_VALUES = (bool, int, float, str)
# The store counter that makes each save's nonce, and so its store keys, unique.
_SAVES_KEY = "d9d/ckpt/saves"


def _check_args(step: Any, metadata: Any, keep: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step=}.")
    if isinstance(keep, bool) or not (keep is None or (isinstance(keep, int) and keep >= 1)):
        raise ValueError(f"keep must be None (keep all) or an int >= 1, got {keep=}.")
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"metadata must be JSON-serializable (dicts, lists, str, numbers, bools, None): "
            f"{exc}. Convert tensors with .tolist() and bytes with base64."
        ) from None


def _records(tree: Any) -> tuple[list[tuple[str, Any]], dict[str, dict[str, Any]]]:
    """The leaves of ``tree`` and the JSON record of each, validated."""
    leaves, _ = tree_lib.flatten_with_paths(tree)
    records: dict[str, dict[str, Any]] = {}
    for path, leaf in leaves:
        if path in records:
            raise ValueError(
                f"Two leaves of the tree have the path {path!r} (e.g. a key 'a.b' beside a "
                "nested {'a': {'b': ...}}); rename one so every path is unique."
            )
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type == "meta":
                raise ValueError(f"Leaf {path!r} is on the meta device and holds no data.")
            layout = layout_of(path, leaf)
            records[path] = {
                "kind": "array",
                "shape": list(layout.shape),
                "dtype": dtype_name(layout.dtype, path),
                "chunks": list(chunk_shape(layout)),
                "file": _format.array_file(path),
                **layout.describe(),
            }
        elif isinstance(leaf, _VALUES):
            records[path] = {"kind": "value", "value": leaf}
        else:
            raise TypeError(
                f"Leaf {path!r} is a {type(leaf).__name__}; checkpoints hold tensors, DTensors, "
                "bool, int, float and str leaves (None is an empty subtree)."
            )
    return leaves, records


def _agree(step: int, nonce: str, records: dict[str, Any]) -> tuple[str, dict, dict]:
    """Gather every rank's records; return rank 0's nonce, the union and each path's holders."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (step, nonce, records))
    union: dict[str, Any] = {}
    holders: dict[str, list[int]] = {}
    for rank, (their_step, _, theirs) in enumerate(gathered):
        if their_step != gathered[0][0]:
            raise ValueError(
                f"save was called with step={gathered[0][0]} on rank 0 and step={their_step} "
                f"on rank {rank}; every rank must save the same step."
            )
        for path, record in theirs.items():
            same = json.dumps(union.setdefault(path, record)) == json.dumps(record)  # NaN too
            if not same:
                raise ValueError(
                    f"Leaf {path!r} differs between ranks {holders[path][0]} and {rank}: "
                    f"{union[path]} vs {record}. Every rank holding a leaf must agree on its "
                    "shape, dtype, layout (and value, for Python values)."
                )
            holders.setdefault(path, []).append(rank)
    return gathered[0][1], dict(sorted(union.items())), holders


def _host_data(tensor: torch.Tensor, snapshot: bool) -> torch.Tensor:
    """The bytes to write: a host copy, or (a synchronous save on CPU) the tensor itself."""
    if not snapshot and tensor.device.type == "cpu":
        # A conjugate or negative view keeps its bit through contiguous(), and its bytes are
        # the unconjugated ones: resolved here, as the host copy's copy_ resolves them.
        return tensor.detach().resolve_conj().resolve_neg().contiguous()
    return host_empty(tensor.shape, tensor.dtype).copy_(tensor.detach())


def _plan(
    leaves: list[tuple[str, Any]],
    records: dict[str, Any],
    holders: dict[str, list[int]],
    rank: int,
    tmp: Path,
    *,
    snapshot: bool,
) -> tuple[list[dict[str, Any]], list[Write]]:
    """The arrays whose metadata this rank creates and the boxes it writes.

    With ``snapshot`` (an asynchronous save) every box is copied to host memory now, so the
    caller may update its tensors while the background thread writes.
    """
    creates, writes = [], []
    for path, leaf in leaves:
        record = records[path]
        if record["kind"] != "array":
            continue
        spec = _format.array_spec(tmp, record)
        if isinstance(leaf, DTensor):
            layout = layout_of(path, leaf)
            coordinate = leaf.device_mesh.get_coordinate()
            offset, shape = local_box(layout, coordinate)
            local = leaf.to_local()
            if tuple(local.shape) != shape:
                raise ValueError(
                    f"Leaf {path!r} holds a local shard of shape {tuple(local.shape)} on rank "
                    f"{rank} (mesh coordinate {coordinate}), but its placements give {shape}: "
                    "build it with distribute_tensor, or from_local(..., shape=, stride=)."
                )
            # A leaf held on several meshes (a head tied to the embedding, on the first and
            # last pipeline stage's) is written by the mesh of its lowest holder only: the
            # others' origins would create its zarr.json again, and their boxes race.
            first = holders[path][0] in leaf.device_mesh.mesh.flatten().tolist()
            mine = first and writes_box(layout, coordinate)
            creator = first and not any(coordinate)
        else:
            offset, shape, local = (0,) * leaf.ndim, tuple(leaf.shape), leaf
            mine = creator = rank == holders[path][0]
        if creator:
            creates.append(spec)
        if mine and math.prod(shape):
            writes.append(Write(spec, offset, _host_data(local, snapshot)))
    return creates, writes


def save(
    directory: str | os.PathLike[str],
    tree: Any,
    *,
    step: int,
    metadata: Any = None,
    async_: bool = True,
    keep: int | None = None,
    hold: bool = False,
) -> SaveHandle:
    """Save ``tree`` as the checkpoint of ``step`` in ``directory``, sharded and atomically.

    Every rank writes only the shards it owns, straight into one zarr v3 array per leaf
    (no gather): a DTensor's local shard goes to its box of the global array, and of
    replicas only the one at coordinate 0 along the unsharding mesh axes writes. Plain
    tensors are whole arrays, written by the lowest rank holding them. Python values
    (``bool``, ``int``, ``float``, ``str``) go into the JSON metadata. The checkpoint
    becomes visible, as ``<directory>/step_<step>``, only once every rank has written
    and rank 0 has committed it; a crash before that leaves older checkpoints intact.

    With ``torch.distributed`` initialised, ``save`` is collective: every rank of the
    default group calls it, in the same order, with the same ``step``. The host copy of
    the local shards is taken before it returns (tensors may be updated in place right
    after); the writing runs in a background thread.

    Args:
        directory: Folder of the run's checkpoints; created if missing.
        tree: A pytree of tensors, DTensors (``Shard``/``Replicate`` placements) and
            Python values; ``None`` is an empty subtree.
        step: The training step, ``>= 0``; names the checkpoint.
        metadata: JSON-serializable data stored with it (rank 0's is kept), e.g. the
            data-loader position. Never pickled.
        async_: Write in a background thread (default ``True``); ``False`` writes and
            commits before returning, straight from CPU tensors without a host copy.
        keep: After committing, delete all but the newest ``keep`` checkpoints in
            ``directory``, never one of a later step than ``step`` (default ``None``:
            keep all).
        hold: Write, but commit only once ``handle.commit()`` is called, or drop the
            data on ``handle.discard()`` (asynchronous saves only; default ``False``);
            discarded if the main thread ends first.
            ``d9d train`` holds each checkpoint until the next step's loss is finite.

    Returns:
        A :class:`SaveHandle`; ``handle.wait()`` blocks until committed and returns the
        checkpoint's path.

    Raises:
        CheckpointExistsError: ``<directory>/step_<step>`` already exists.
        DonatedTreeError: A leaf was donated to a ``d9d.jit`` call (the tree passed to a
            jitted step, not the one it returned): its buffer holds that call's new values.
        TypeError: A leaf is of an unsupported type or dtype, or ``metadata`` is not JSON.
        ValueError: ``step`` or ``keep`` is invalid, two leaves share a path, a leaf is
            on the meta device or ``Partial``, or ranks disagree on the step or a leaf.
        CheckpointSaveError: (from ``wait()``, or here when ``async_=False``) writing
            failed on some rank; nothing was committed.

    Example:
        >>> import tempfile, torch
        >>> from d9d.checkpoint import latest
        >>> run = tempfile.mkdtemp()
        >>> handle = save(run, {"w": torch.ones(2, 3), "step": 7}, step=7)
        >>> handle.wait() == latest(run)
        True
    """
    directory = Path(directory)
    _check_args(step, metadata, keep)
    if hold and not async_:
        raise ValueError("hold=True needs async_=True: a synchronous save commits before returning")
    final = _format.step_path(directory, step)
    if final.exists():
        raise CheckpointExistsError(
            f"{str(final)!r} already exists; save under a new step, or delete it first."
        )
    # A donated tree's buffers hold a later step's values: saved under ``step`` they would be
    # a checkpoint of step N holding step N+1 (the save copies what it writes before it
    # returns, so a tree saved before the next jitted call is safe).
    check_not_donated(tree, name="the tree to save")
    leaves, records = _records(tree)
    nonce = secrets.token_hex(4)
    rank, world, store = 0, 1, None
    holders = {path: [0] for path in records}
    if dist.is_initialized() and dist.get_world_size() > 1:
        rank, world = dist.get_rank(), dist.get_world_size()
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            # The nonce names the store keys the ranks meet through, which stay after the
            # save: one drawn again (32 bits) read an earlier save's outcomes and committed
            # without waiting for the other ranks. The count of this store's saves never repeats.
            nonce = f"{store.add(_SAVES_KEY, 1)}-{nonce}"
    tmp = _format.tmp_path(directory, step, nonce)  # rank 0's nonce is the one all ranks use
    # Claimed before any rank can write into it (they do after _agree), so that no rotation
    # ever takes it for a dead save's leftover.
    claim = None
    if rank == 0:
        # A folder that cannot be made fails the writes into it too, and wait() says why.
        with contextlib.suppress(OSError):
            claim = _claim.claim(tmp)
    agreed = False
    try:
        if world > 1:
            nonce, records, holders = _agree(step, nonce, records)
            tmp, agreed = _format.tmp_path(directory, step, nonce), True
        creates, writes = _plan(leaves, records, holders, rank, tmp, snapshot=async_)
    except BaseException as exc:
        if claim is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            claim.release()
        if agreed:  # the other ranks' saves are under way: post the failure, so none waits
            with contextlib.suppress(RuntimeError):  # a store that is gone: raise the error
                post_failure(store, f"d9d/ckpt/{nonce}", rank, brief(exc))
        raise
    meta = {
        "format": _format.FORMAT,
        "step": step,
        "world_size": world,
        "leaves": records,
        "metadata": metadata,
        "checksum": "crc32c in every chunk (zarr v3 crc32c codec), verified on every read",
    }
    gate = threading.Event() if hold else None
    key = f"d9d/ckpt/{nonce}"
    job = WriteJob(tmp, final, meta, keep, creates, writes, rank, world, store, key, gate, claim)
    if not async_:
        job.run()
        handle = SaveHandle(final, job, None)
        handle.wait()
        return handle
    thread = threading.Thread(target=job.run, name=f"d9d-checkpoint-step-{step}")
    thread.start()
    return SaveHandle(final, job, thread)
