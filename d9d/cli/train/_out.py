"""``--out`` of ``d9d train``: a fresh run never writes into another run's folder.

Without ``--resume`` (or ``--resume-from``), an ``--out`` that already holds a run (its
``config.json``, ``metrics.jsonl`` or a checkpoint) is refused before anything is written:
starting there used to truncate the old ``metrics.jsonl``, rewrite its ``config.json`` and
then fail at the first save of a step the old run had committed (issue 23). We refuse rather
than move the old run aside, so that no run's gigabytes of checkpoints pile up unnoticed and
every command line means one thing. Under a process group rank 0 looks and tells the others
(one broadcast), so no rank sees a folder rank 0 has begun to write.

A torchft replica group restarted with its command (``--fault-tolerant``) continues in its
``--out``: a folder whose ``config.json`` is that of the same replica group is not refused,
unless it holds checkpoints: those need ``--resume`` (the group restores its newest, and heals
from the live groups if they are ahead), else the group would start at step 0 and, if every
group did, fail at its first save of a step the old run had committed.

Two runs at once in one ``--out`` (a job launched twice, a requeued job beside the one it
replaces) both found the folder empty and wrote into it: the folder kept one run's
``config.json`` and records beside the other's checkpoints, and a ``--resume`` restored
those under the wrong flags. So rank 0 holds an exclusive ``flock`` on the folder from before
it looks until the run ends (:func:`lock_out`), and a second run, resumed or not, is refused.
The kernel drops the lock of a process that dies, so a killed run leaves none behind; where
folders cannot be locked (NFS maps ``flock`` to byte-range locks, which need a file open for
writing; Lustre without ``-o flock``) the run goes on unlocked, as checkpoint claims do
(``d9d/checkpoint/_claim.py``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path

import torch.distributed as dist

from ...checkpoint._claim import Claim
from ...errors import ConfigError

__all__ = ["check_fresh_out", "lock_out"]

# What a run writes first (rank 0): either one means a run has been there.
_RUN_FILES = ("config.json", "metrics.jsonl")


def _run_files(out: Path) -> list[str]:
    found = [name for name in _RUN_FILES if (out / name).exists()]
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        found.append("checkpoints/")
    return found


def _replica_group_of(out: Path) -> int | None:
    """The ``replica_group_id`` of the fault-tolerant run in ``out``, if it holds one."""
    try:
        saved = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("fault_tolerant") is not True:
        return None
    group = saved.get("replica_group_id")
    return group if isinstance(group, int) else None


def check_fresh_out(out: Path, *, resuming: bool, replica_group: int | None = None) -> None:
    """Refuse to start a fresh run in ``out`` when it holds another run (collective
    under a process group: every rank calls it, before rank 0 writes into ``out``).

    Args:
        out: The run's folder (``--out``).
        resuming: ``--resume`` or ``--resume-from`` was given: continuing there is the point.
        replica_group: This run's ``--replica-group-id`` under ``--fault-tolerant``: ``out``
            may hold that same replica group's run, which a restart continues (one with
            checkpoints only with ``resuming``).

    Raises:
        ConfigError: ``out`` holds a run and ``resuming`` is false (nor is it this replica
            group's without checkpoints); the message names what was found, ``--resume`` and
            a new ``--out``.

    Example:
        >>> import tempfile
        >>> check_fresh_out(Path(tempfile.mkdtemp()), resuming=False)  # empty: fine
    """
    if resuming:
        return
    found = _run_files(out)
    if found and replica_group is not None and _replica_group_of(out) == replica_group:
        if "checkpoints/" in found:
            raise ConfigError(
                f"--out {str(out)!r} holds replica group {replica_group}'s run with "
                "checkpoints; pass --resume: the group restores its newest checkpoint, and "
                "takes the live groups' state instead if they are ahead of it (nothing was "
                "written)"
            )
        found = []  # this replica group's run before a restart: it rejoins there
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdict = [found]
        dist.broadcast_object_list(verdict, src=0)
        found = verdict[0]
    if found:
        raise ConfigError(
            f"--out {str(out)!r} already holds a run ({', '.join(found)}); pass --resume to "
            "continue it, or a new --out to start another (nothing was written)"
        )


def _lock(out: Path) -> tuple[int | None, bool]:
    """A descriptor of ``out`` (created) holding its lock, or ``None``; and whether another
    process holds the lock."""
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:  # held by another run, or locks unsupported: run unlocked
        os.close(fd)
        return None, exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    return fd, False


def lock_out(out: Path) -> Claim:
    """Lock ``out`` for this run, refusing while another run holds it (collective under a
    process group: rank 0 creates and locks the folder and tells the others).

    Call it before :func:`check_fresh_out`, so that no other run starts writing between the
    look and the run's first write; release the lock once the run's last write is done.

    Raises:
        ConfigError: Another process holds ``out``'s lock (a run still going, or still
            committing its last checkpoint).
        OSError: ``out`` cannot be created (a file of that name, a read-only parent).

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> lock = lock_out(folder)
        >>> try:
        ...     lock_out(folder)
        ... except ConfigError as error:
        ...     print(str(error).split(",")[0].endswith("is in use by another d9d train run"))
        True
        >>> lock.release()
        >>> lock_out(folder).release()  # free again
    """
    fd, busy, error = None, False, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            fd, busy = _lock(out)
        except OSError as exc:
            error = exc
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdict = [busy, error]
        dist.broadcast_object_list(verdict, src=0)
        busy, error = verdict
    if error is not None:
        raise error
    if busy:
        raise ConfigError(
            f"--out {str(out)!r} is in use by another d9d train run, which holds its lock "
            "until it ends (its last checkpoint committed); wait for it, or pass a new --out "
            "(nothing was written)"
        )
    return Claim(fd)
