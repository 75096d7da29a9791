"""How ``d9d train --resume`` / ``--resume-from`` picks, checks and restores a checkpoint.

* The flags that change the schedule or the model must equal the ``config.json`` of the run
  that wrote the checkpoint, unless ``--allow-config-change``; those that lay the optimizer
  state out (``STATE_FLAGS``) or fix the data order the saved position counts in
  (``DATA_ORDER_FLAGS``) must equal it.
* ``--resume`` tries every ``step_<N>`` folder newest first and falls back past damaged ones
  (no ``COMMIT`` or ``metadata.json``, unparsable metadata, a chunk failing its checksum);
  ``--resume-from PATH`` restores exactly PATH or fails. Every rank must read its slices;
  ranks agree on the outcome.
* Folders newer than the restored one, damaged or not, are moved aside
  (``step_<N>.abandoned``, one warning line each): the resumed run writes its own
  ``step_<N>``, and they are kept for inspection, never deleted.
* A checkpoint saved by another number of ranks restores onto this run's layout; its per-rank
  RNG states cannot be, so they are left as this run seeded them (with a warning).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ... import checkpoint
from ...checkpoint import _format
from ...data import TokenLoader
from ...errors import CheckpointCorruptError, CheckpointNotFoundError, ConfigError, DataError

__all__ = [
    "DATA_ORDER_FLAGS",
    "SCHEDULE_FLAGS",
    "STATE_FLAGS",
    "check_is_checkpoint",
    "check_unchanged",
    "load_data_position",
    "restore",
    "say",
    "set_aside_newer",
]

# Flags that change the model, the learning-rate schedule or the data order.
SCHEDULE_FLAGS = (
    "model",
    "preset",
    "steps",
    "lr",
    "warmup",
    "weight_decay",
    "clip",
    "batch_size",
    "seq_len",
    "seed",
    "data",
    "token_dtype",
    "vocab_size",
    "eval_fraction",
)


# Schedule flags that fix which rows each step reads: the checkpoint's data position is a
# step of batches of this size, length and order, so they cannot change in a resumed run.
DATA_ORDER_FLAGS = ("batch_size", "seq_len", "seed")


# Flags that change the optimizer state's layout: a checkpoint restores only into its own.
STATE_FLAGS = ("offload_opt_state", "opt_state_dtype", "master_weights", "diloco")


def _layout(name: str, value: Any) -> Any:
    """What of a ``STATE_FLAGS`` value lays the state out: ``--diloco``'s H does not."""
    return value is not None if name == "diloco" else value


def say(text: str) -> None:
    """One line to standard error, from rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"d9d train: {text}", file=sys.stderr, flush=True)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _schedule(config: dict[str, Any]) -> dict[str, Any]:
    """The schedule flags of a ``config.json`` dict, warmup as the schedule uses it."""
    values = {name: config.get(name) for name in SCHEDULE_FLAGS}
    values["model"] = values["model"] or "llama"  # runs from before --model were all llama
    values["token_dtype"] = values["token_dtype"] or "uint16"  # and before --token-dtype, uint16
    # Tokens are held out of training only while evaluating: 0.0 means none.
    values["eval_fraction"] = values["eval_fraction"] if config.get("eval_every") else 0.0
    if isinstance(values["warmup"], int) and isinstance(values["steps"], int):
        values["warmup"] = min(values["warmup"], max(values["steps"] - 1, 0))
    return values


def check_unchanged(current: dict[str, Any], saved_file: Path, *, allow: bool) -> None:
    """Refuse, naming each flag, when a schedule flag differs from ``saved_file``.

    Args:
        current: This run's config as ``config.json`` would hold it.
        saved_file: The ``config.json`` of the run that wrote the checkpoint.
        allow: ``--allow-config-change``: warn instead of refusing, except for
            ``DATA_ORDER_FLAGS``.

    Raises:
        ConfigError: A flag differs and ``allow`` is false, or a ``DATA_ORDER_FLAGS`` one
            differs.
    """
    try:
        saved = json.loads(saved_file.read_text())
    except (OSError, ValueError) as error:
        say(f"warning: cannot check the flags against {str(saved_file)!r} ({error})")
        return
    if not isinstance(saved, dict):
        say(f"warning: cannot check the flags against {str(saved_file)!r} (not a JSON object)")
        return
    laid_out = [
        f"{_flag(name)} {current.get(name)} (was {saved[name]})"
        for name in STATE_FLAGS
        if name in saved and _layout(name, saved[name]) != _layout(name, current.get(name))
    ]
    if laid_out:
        raise ConfigError(
            f"{', '.join(laid_out)}: the checkpoint's optimizer state is laid out for the "
            f"run that wrote it ({str(saved_file)!r}) and cannot be restored into this one's; "
            "pass the old value to resume it"
        )
    old, new = _schedule(saved), _schedule(current)
    changed = [
        f"{_flag(name)} {new[name]} (was {old[name]})"
        for name in SCHEDULE_FLAGS
        if old[name] != new[name]
    ]
    if not changed:
        return
    listed = ", ".join(changed)
    reordered = [
        f"{_flag(name)} {new[name]} (was {old[name]})"
        for name in DATA_ORDER_FLAGS
        if old[name] != new[name]
    ]
    if allow and reordered:
        raise ConfigError(
            f"{', '.join(reordered)}: the checkpoint's data position counts steps of "
            f"{old['batch_size']} sequences of {old['seq_len']} tokens in --seed "
            f"{old['seed']}'s order, and cannot be carried to another, even with "
            "--allow-config-change (which lets the other schedule flags change); pass the old "
            "values to resume, or start a new run in another --out"
        )
    if allow:
        say(f"warning: resuming with changed flags: {listed} (--allow-config-change)")
        return
    verb = "differs" if len(changed) == 1 else "differ"
    raise ConfigError(
        f"{listed} {verb} from {str(saved_file)!r} of the run that wrote the checkpoint, and "
        "changes the schedule or the model. Pass the old values to resume that run, or "
        "--allow-config-change to resume with the new ones"
    )


def load_data_position(loader: TokenLoader, position: Any, path: Path) -> None:
    """Move ``loader`` to the data position the checkpoint ``path`` saved, refusing in the
    flags' words one saved reading other tokens (``--data`` rewritten, another
    ``--token-dtype`` or ``--eval-fraction``); the loader checks the rest.

    Raises:
        DataError: The position was saved on other tokens, or is no loader position.
    """
    mine = loader.state_dict()
    differ = [
        f"{key} {position[key]} (this run's: {mine[key]})"
        for key in ("num_windows", "tokens_digest")
        if isinstance(position, dict) and key in position and position[key] != mine[key]
    ]
    if differ:
        raise DataError(
            f"{str(path)!r} was saved reading other tokens than this run reads "
            f"({', '.join(differ)}): pass the --data (with the files it held then), "
            "--token-dtype and --eval-fraction of the run that wrote it, or start a new run in "
            "another --out"
        )
    loader.load_state_dict(position)


def check_is_checkpoint(path: Path) -> None:
    """Refuse ``--resume-from`` given a run's folder (or its ``checkpoints``), naming the
    newest checkpoint in it."""
    held = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = [folder for _, folder in _format.step_folders(held)]
    if not (path / _format.COMMIT).is_file() and steps:
        raise CheckpointNotFoundError(
            f"--resume-from {str(path)!r} is a run's folder, not a checkpoint; pass one of its "
            f"checkpoints, the newest being --resume-from {str(steps[-1])!r}, or --resume "
            f"with --out {str(held.parent)!r}"
        )


def _agree(problem: BaseException | None) -> BaseException | None:
    """The first rank's problem, on every rank (``None``: every rank succeeded)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return problem
    mine = None if problem is None else (isinstance(problem, CheckpointNotFoundError), str(problem))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    for rank, theirs in enumerate(gathered):
        if theirs is not None:
            kind = CheckpointNotFoundError if theirs[0] else CheckpointCorruptError
            return kind(f"rank {rank}: {theirs[1]}")
    return None


def _try_restore(path: Path, restore_one: Callable[[Path, bool], Any]) -> tuple[Any, Any]:
    """``restore_one(path, restore_rng)``, or why it failed (agreed by every rank)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    state, problem = None, None
    try:
        saved_world = checkpoint.metadata(path)["world_size"]
        if saved_world != world:
            say(
                f"warning: {str(path)!r} was saved by {saved_world} ranks and this run has "
                f"{world}; params, optimizer state and data position are resharded, the RNG "
                "states start afresh from --seed"
            )
        state = restore_one(path, saved_world == world)
    except (CheckpointCorruptError, CheckpointNotFoundError) as error:
        problem = error
    return state, _agree(problem)


def _why_damaged(path: Path) -> str | None:
    """Why the ``step_<N>`` folder ``path`` is no checkpoint at all (``None``: it has its
    commit's files, so restoring it decides)."""
    missing = _format.missing_markers(path)
    return f"it has no {' and no '.join(missing)}" if missing else None


def restore(
    directory: Path, resume_from: Path | None, restore_one: Callable[[Path, bool], Any]
) -> Any:
    """The train state to continue from, or ``None`` to start at step 1.

    With ``resume_from`` ``None``, every ``step_<N>`` folder of ``directory`` is tried,
    newest first; the damaged ones newer than the one restored (no ``COMMIT`` or
    ``metadata.json``, metadata that does not parse, an array that fails its checks on any
    rank) are moved aside as ``step_<N>.abandoned`` by rank 0, each with one warning line
    naming the folder and why, so this run can save that step afresh. Nothing is moved when
    none can be restored.

    Args:
        directory: The run's checkpoint folder (``OUT/checkpoints``).
        resume_from: ``--resume-from``; ``None``: the newest readable one in ``directory``.
        restore_one: ``restore_one(path, restore_rng) -> TrainState``.

    Raises:
        CheckpointCorruptError: ``resume_from`` is damaged, or every checkpoint is.
        CheckpointNotFoundError: ``resume_from`` is not a committed checkpoint.
    """
    if resume_from:
        candidates = [resume_from]
    else:
        candidates = [path for _, path in reversed(_format.step_folders(directory))]
    if not candidates:
        say(f"no checkpoint in {str(directory)!r}; starting at step 1")
        return None
    damaged: list[tuple[Path, str]] = []
    for path in candidates:
        why = None if resume_from else _why_damaged(path)
        if why is None:
            state, problem = _try_restore(path, restore_one)
            if problem is None:
                for bad, bad_why in damaged:
                    _move_aside(bad, f"cannot be restored ({bad_why})")
                say(f"resumed from {str(path)!r} at step {state.step + 1}")
                return state
            if resume_from:
                raise problem
            why = str(problem)
        damaged.append((path, " ".join(why.split())))
    for path, why in damaged:
        say(f"warning: {str(path)!r} cannot be restored ({why})")
    raise CheckpointCorruptError(
        f"every checkpoint in {str(directory)!r} is damaged ({[p.name for p in candidates]}); "
        "pass --resume-from with a good copy, or delete the folder to start afresh"
    )


def _move_aside(path: Path, why: str) -> None:
    """Rename ``path`` to ``step_<N>.abandoned`` (or ``-1``, ``-2``...), saying why (rank 0)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    aside, n = path.with_name(f"{path.name}.abandoned"), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.abandoned-{n}"), n + 1
    os.rename(path, aside)
    say(f"warning: {str(path)!r} {why}; moved it aside to {aside.name!r}")


def set_aside_newer(directory: Path, step: int) -> None:
    """Rename the ``step_<N>`` folders past ``step`` to ``step_<N>.abandoned`` (rank 0)."""
    for n, path in _format.step_folders(directory):
        if n > step:
            _move_aside(path, f"is past step {step}, where this run resumed")
