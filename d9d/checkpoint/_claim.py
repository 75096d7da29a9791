"""A save's claim on the ``step_<N>.tmp-<nonce>`` folder it writes into.

Rank 0 of a save creates the folder and holds an exclusive ``flock`` on it from then until the
folder is committed (renamed) or removed. The kernel drops the locks of a process that dies,
so a folder whose lock a rotation can take belongs to no live save: it is provably abandoned,
and only then is it removed. Two saves of one step used to race here: the winner's rotation
removed the loser's folder mid-commit, which then failed with ``FileNotFoundError`` (issue 23).

Where directories cannot be locked (NFS maps ``flock`` to byte-range locks, which need a file
open for writing; Lustre without ``-o flock``), nothing is proven abandoned, so rotations
remove no ``.tmp-`` folder there; :func:`d9d.checkpoint.sweep` at the start of a run still does.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

__all__ = ["Claim", "abandoned", "claim"]


class Claim:
    """A held lock on a folder (or, where locks are unsupported, none)."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def release(self) -> None:
        """Let go of the folder (once it is committed, or removed); idempotent."""
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def _open(folder: Path) -> int | None:
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):  # gone, or a file of that name
        return None


def _still_named(fd: int, folder: Path) -> bool:
    """Whether ``folder`` still names the directory open as ``fd`` (not removed or renamed)."""
    try:
        named = os.stat(folder)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def claim(folder: Path) -> Claim:
    """Create ``folder`` (and its parents) and lock it for the save writing into it.

    A rotation may lock a folder in the moment between its creation and this lock, taking it
    for abandoned: then it removes it, and the folder is made afresh.
    """
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        fd = _open(folder)
        if fd is None:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits only for a rotation removing it
        except OSError:  # no locks here: rotations remove no .tmp- folder either
            return Claim(fd)
        if _still_named(fd, folder):
            return Claim(fd)
        os.close(fd)


def abandoned(folder: Path, *, unlockable: bool = False) -> Claim | None:
    """A claim on ``folder`` if no live save holds it, else ``None`` (also when unprovable,
    unless ``unlockable``: then a folder that cannot be locked counts as abandoned, with a
    claim that holds no lock, as ``sweep`` takes it at a run's start).

    Remove the folder while holding the returned claim, then release it.
    """
    fd = _open(folder)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:  # held by a save in flight, or locks unsupported
        os.close(fd)
        held = exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
        return Claim(None) if unlockable and not held else None
    if not _still_named(fd, folder):  # committed (renamed) or removed since it was listed
        os.close(fd)
        return None
    return Claim(fd)
