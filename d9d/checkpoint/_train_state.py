"""A training run's whole state in one checkpoint: params, optimizer state, step, data, RNG."""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointMismatchError
from ._format import metadata as read_metadata
from ._restore import restore
from ._save import SaveHandle, save

__all__ = ["TrainState", "restore_train_state", "save_train_state"]


@dataclass(frozen=True)
class TrainState:
    """A restored training state.

    Attributes:
        step: The step the checkpoint was saved at (steps done so far).
        params: The params, laid out like the target params.
        opt_state: The optimizer state, laid out like the target optimizer state.
        data: The ``data`` saved with it, e.g. ``TokenLoader.state_dict()``.
        metadata: The user ``metadata`` saved with it.
    """

    step: int
    params: Any
    opt_state: Any
    data: Any
    metadata: Any


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _rng_states() -> list[dict[str, str]]:
    """This process's RNG states (CPU, and the current CUDA device if used), per rank."""
    mine = {"cpu": _encode(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["cuda"] = _encode(torch.cuda.get_rng_state())
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def save_train_state(
    directory: str | os.PathLike[str],
    *,
    step: int,
    params: Any,
    opt_state: Any,
    data: Any = None,
    metadata: Any = None,
    keep: int | None = None,
    async_: bool = True,
    hold: bool = False,
) -> SaveHandle:
    """Save params, optimizer state, step, data position and every rank's RNG state.

    A :func:`~d9d.checkpoint.save` of ``{"params": params, "opt_state": opt_state}``
    whose metadata also holds ``data`` and the RNG states (base64 of the generator
    bytes, one entry per rank). Collective like ``save``.

    Args:
        directory: Folder of the run's checkpoints.
        step: Steps done so far; names the checkpoint.
        params: The params tree.
        opt_state: The optimizer state tree.
        data: JSON-serializable data position, e.g. ``TokenLoader.state_dict()``.
        metadata: JSON-serializable user metadata.
        keep: Keep only the newest ``keep`` checkpoints (default: all).
        async_: Write in the background (default ``True``).
        hold: Commit only on ``handle.commit()`` (see :func:`~d9d.checkpoint.save`).

    Returns:
        The :class:`~d9d.checkpoint.SaveHandle` of the save.

    Raises:
        Whatever :func:`~d9d.checkpoint.save` raises.

    Example:
        >>> import tempfile
        >>> run = tempfile.mkdtemp()
        >>> params = {"w": torch.ones(2)}
        >>> save_train_state(run, step=5, params=params, opt_state=(), data={"pos": 5}).wait().name
        'step_5'
    """
    extra = {"data": data, "rng": _rng_states(), "user": metadata}
    tree = {"params": params, "opt_state": opt_state}
    return save(directory, tree, step=step, metadata=extra, keep=keep, async_=async_, hold=hold)


def restore_train_state(
    path: str | os.PathLike[str],
    *,
    params: Any,
    opt_state: Any,
    restore_rng: bool = True,
    partial: bool = False,
) -> TrainState:
    """Restore a :func:`save_train_state` checkpoint onto the layout of ``params``/``opt_state``.

    Also sets this process's RNG states to the ones this rank saved, so random draws
    continue as in an uninterrupted run.

    Args:
        path: The checkpoint folder (e.g. ``d9d.checkpoint.latest(run_dir)``).
        params: Target params tree (tensors, DTensors or ``Abstract`` leaves).
        opt_state: Target optimizer state tree.
        restore_rng: Set the RNG states (default ``True``); needs the same world size
            as the run that saved.
        partial: Restore only the targets' paths from a checkpoint that holds more (a
            pipeline rank's stage of a checkpoint of every stage).

    Returns:
        A :class:`TrainState` with new params and optimizer state.

    Raises:
        CheckpointMismatchError: The targets do not match the checkpoint, or it holds the
            RNG states of another number of ranks (pass ``restore_rng=False``).
        CheckpointNotFoundError: ``path`` is not a committed checkpoint.
        CheckpointCorruptError: An array is missing or fails its checksum.

    Example:
        >>> import tempfile
        >>> run = tempfile.mkdtemp()
        >>> path = save_train_state(run, step=3, params={"w": torch.ones(2)}, opt_state=()).wait()
        >>> state = restore_train_state(path, params={"w": torch.zeros(2)}, opt_state=())
        >>> state.step, state.params["w"]
        (3, tensor([1., 1.]))
    """
    meta = read_metadata(path)
    extra = meta["metadata"]
    if not isinstance(extra, dict) or set(extra) != {"data", "rng", "user"}:
        raise CheckpointMismatchError(
            f"{str(path)!r} was not written by save_train_state (its metadata has no train "
            "state); restore it with d9d.checkpoint.restore."
        )
    rng = extra["rng"]
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if restore_rng and len(rng) != world:
        raise CheckpointMismatchError(
            f"{str(path)!r} holds the RNG states of {len(rng)} ranks and this run has {world}; "
            "pass restore_rng=False to keep this run's RNG states."
        )
    target = {"params": params, "opt_state": opt_state}
    tree = restore(path, target, partial=partial)
    if restore_rng:
        torch.set_rng_state(_decode(rng[rank]["cpu"]))
        if "cuda" in rng[rank] and torch.cuda.is_available():
            torch.cuda.set_rng_state(_decode(rng[rank]["cuda"]))
    return TrainState(meta["step"], tree["params"], tree["opt_state"], extra["data"], extra["user"])
