"""``TokenLoader``: packed, shuffled, data-parallel-sharded and resumable batches of tokens."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, final

import numpy as np
import torch

from d9d.errors import DataError

from ._corpus import byte_corpus
from ._digest import tokens_digest
from ._packing import epoch_permutation, gather_windows, num_windows
from ._token_file import token_file

__all__ = ["TokenLoader"]

Source = np.ndarray | str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

# Kept in ``state_dict``; the config entries must match on ``load_state_dict``.
_CONFIG_KEYS = ("seed", "seq_len", "global_batch_size", "num_windows", "tokens_digest")
_STATE_KEYS = ("step", "epoch", *_CONFIG_KEYS)
# A state saved before ``tokens_digest`` was kept is checked without it.
_OLD_STATE_KEYS = frozenset(_STATE_KEYS) - {"tokens_digest"}
_WHY = {"tokens_digest": " (other tokens: another file or corpus, or one edited since)"}


def _tokens_of(source: Source) -> np.ndarray:
    """An array is used as is, one ``.bin`` file is memory-mapped, anything else read as text."""
    if isinstance(source, np.ndarray):
        if source.ndim != 1 or source.dtype.kind not in "iu":
            raise DataError(
                f"a token array must be 1-D of an integer dtype, got shape={source.shape} "
                f"dtype={source.dtype}; flatten it, or pass paths to read"
            )
        return source
    if isinstance(source, str | os.PathLike) and Path(source).suffix == ".bin":
        return token_file(source)
    if isinstance(source, str | os.PathLike):
        return byte_corpus(source)
    if isinstance(source, Sequence):
        not_paths = [item for item in source if not isinstance(item, str | os.PathLike)]
        if not_paths:
            raise DataError(
                f"a {type(source).__name__} source is read as a list of paths of text, but it "
                f"holds {type(not_paths[0]).__name__} {not_paths[0]!r}: pass token ids as a 1-D "
                "integer np.ndarray (np.asarray(ids)), or a list of paths"
            )
        token_files = [str(path) for path in source if Path(path).suffix == ".bin"]
        if token_files:
            raise DataError(
                f"token files {token_files} are in a list of paths read as text; pass one .bin "
                "file on its own (concatenate several into one first)"
            )
        return byte_corpus(source)
    raise DataError(
        f"cannot read tokens from a {type(source).__name__}; pass a 1-D integer np.ndarray, "
        "a .bin token file, or text files/directories (a path or a list of paths)"
    )


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if is_int and value >= low and (high is None or value < high):
        return
    bound = f"an int >= {low}" if high is None else f"an int in [{low}, {high})"
    raise ValueError(f"{name} must be {bound}, got {name}={value!r}")


@final
class TokenLoader:
    """Batches of ``seq_len``-token sequences and their next-token labels, for one dp rank.

    The token stream is cut into windows of ``seq_len + 1`` tokens (see ``num_windows``).
    Epoch ``e`` visits all windows once, in the order ``epoch_permutation(seed=seed,
    epoch=e)``; epochs follow one another without a gap, so one global batch may hold the
    last windows of an epoch and the first of the next. Global batch ``step`` is samples
    ``[step * global_batch_size, (step + 1) * global_batch_size)`` of that endless sequence,
    a pure function of ``(step, seed, seq_len, global_batch_size)`` and the tokens.

    Data-parallel rank ``r`` gets rows ``[r * B, (r + 1) * B)`` of the global batch, where
    ``B = global_batch_size // dp_size``; concatenating the batches of all ranks in rank
    order gives the batch one device with ``dp_size=1`` gets. The position (``state_dict``)
    is the same on every rank and does not depend on ``dp_size``, so a run may resume on a
    different number of ranks.

    Iterating never stops: ``next(loader)`` returns ``batch(loader.step)`` and advances
    ``step``. Batches are CPU tensors made fresh from the token array each time.

    Args:
        source: the tokens. A 1-D integer ``np.ndarray`` (or memmap) is used as is; a single
            path ending in ``.bin`` is a token file, memory-mapped as ``np.uint16`` (call
            ``token_file`` yourself for another dtype); any other path or list of paths is
            read as text by ``byte_corpus`` (such a list may not hold ``.bin`` files).
        global_batch_size: sequences per step over all dp ranks.
        seq_len: tokens per sequence.
        seed: data order seed, in ``[0, 2**64)``. Default 0.
        dp_rank: this rank's data-parallel index (its ``dp`` x ``fsdp`` coordinate). Default 0.
        dp_size: number of data-parallel ranks. Default 1.

    Raises:
        DataError: the source is missing or empty, or packs into fewer windows than one
            global batch.
        ValueError: a size is not a positive int, ``dp_rank`` is outside ``[0, dp_size)``,
            or ``global_batch_size`` is not divisible by ``dp_size``.

    Example:
        >>> loader = TokenLoader(np.arange(100) % 256, global_batch_size=4, seq_len=8)
        >>> batch = next(loader)
        >>> batch["tokens"].shape, batch["labels"].dtype
        (torch.Size([4, 8]), torch.int64)
        >>> bool((batch["tokens"][:, 1:] == batch["labels"][:, :-1]).all())
        True
    """

    def __init__(
        self,
        source: Source,
        *,
        global_batch_size: int,
        seq_len: int,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        _check_int("global_batch_size", global_batch_size, 1)
        _check_int("seq_len", seq_len, 1)
        _check_int("seed", seed, 0, 2**64)
        _check_int("dp_size", dp_size, 1)
        _check_int("dp_rank", dp_rank, 0, dp_size)
        if global_batch_size % dp_size:
            raise ValueError(
                f"{global_batch_size=} is not divisible by {dp_size=}: every data-parallel rank "
                f"takes an equal share; use a multiple of {dp_size}, e.g. "
                f"{(global_batch_size // dp_size + 1) * dp_size}"
            )
        tokens = _tokens_of(source)
        windows = num_windows(tokens.size, seq_len)
        if windows < global_batch_size:
            raise DataError(
                f"too few tokens: {tokens.size} tokens pack into {windows} windows of "
                f"seq_len + 1 = {seq_len + 1} tokens, fewer than {global_batch_size=}; one "
                f"global batch needs at least {global_batch_size * seq_len + 1} tokens: use more "
                "data, a smaller seq_len or a smaller global_batch_size"
            )
        self._tokens = tokens
        self._num_windows = windows
        self._global_batch_size = global_batch_size
        self._local_batch_size = global_batch_size // dp_size
        self._seq_len = seq_len
        self._seed = seed
        self._dp_rank = dp_rank
        self._step = 0
        self._digest: int | None = None  # tokens_digest(tokens), read when first needed
        # Permutations of the last two epochs touched: a batch spans at most two.
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def tokens(self) -> np.ndarray:
        """The 1-D token stream (read-only array or memmap)."""
        return self._tokens

    @property
    def num_windows(self) -> int:
        """Sequences (windows of ``seq_len + 1`` tokens) per epoch."""
        return self._num_windows

    @property
    def tokens_digest(self) -> int:
        """``d9d.data.tokens_digest`` of ``tokens``: what ``load_state_dict`` checks the data by."""
        if self._digest is None:
            self._digest = tokens_digest(self._tokens)
        return self._digest

    @property
    def step(self) -> int:
        """Index of the global batch ``next`` returns."""
        return self._step

    @property
    def epoch(self) -> int:
        """Epoch of the first sample of the global batch ``next`` returns."""
        return self._step * self._global_batch_size // self._num_windows

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            if len(self._permutations) == 2:
                del self._permutations[next(iter(self._permutations))]
            self._permutations[epoch] = epoch_permutation(
                self._num_windows, seed=self._seed, epoch=epoch
            )
        return self._permutations[epoch]

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's rows of global batch ``step``, without moving the loader's position.

        Args:
            step: global batch index, from 0.

        Returns:
            ``{"tokens": LongTensor[B, seq_len], "labels": LongTensor[B, seq_len]}`` with
            ``B = global_batch_size // dp_size`` and ``labels[:, i] == next token after
            tokens[:, i]``.

        Raises:
            ValueError: ``step`` is not an int >= 0.
        """
        _check_int("step", step, 0)
        first = step * self._global_batch_size + self._dp_rank * self._local_batch_size
        samples = np.arange(first, first + self._local_batch_size, dtype=np.int64)
        epochs, positions = np.divmod(samples, self._num_windows)
        windows = np.empty_like(samples)
        for epoch in np.unique(epochs).tolist():
            in_epoch = epochs == epoch
            windows[in_epoch] = self._permutation(epoch)[positions[in_epoch]]
        rows = gather_windows(self._tokens, windows, self._seq_len)
        rows = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        return {"tokens": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = self.batch(self._step)
        self._step += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """The position, JSON-serializable: ``step`` and ``epoch`` of the next batch, plus the
        config and data it is valid for (``seed``, ``seq_len``, ``global_batch_size``,
        ``num_windows``, ``tokens_digest``).

        Identical on every dp rank. Store it with the train state and pass it to
        ``load_state_dict`` to continue exactly where this loader is.
        """
        return {
            "step": self._step,
            "epoch": self.epoch,
            "seed": self._seed,
            "seq_len": self._seq_len,
            "global_batch_size": self._global_batch_size,
            "num_windows": self._num_windows,
            "tokens_digest": self.tokens_digest,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Moves to the position ``state`` (from ``state_dict``) records.

        Args:
            state: a ``state_dict()`` result, e.g. read back from JSON.

        Raises:
            DataError: a key is missing or unknown, a value is not an int, or the state was
                saved with another ``seed``, ``seq_len``, ``global_batch_size`` or data
                (``num_windows``, ``tokens_digest``): resuming would then not continue the
                same data order. A state saved before ``tokens_digest`` existed is checked
                without it.
        """
        if not isinstance(state, Mapping) or set(state) not in (set(_STATE_KEYS), _OLD_STATE_KEYS):
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise DataError(
                f"not a TokenLoader state: got keys {keys}, expected {sorted(_STATE_KEYS)}; "
                "pass what TokenLoader.state_dict() returned"
            )
        bad = {k: v for k, v in state.items() if not isinstance(v, int) or isinstance(v, bool)}
        if bad or state["step"] < 0:
            raise DataError(f"TokenLoader state values must be ints, step >= 0; got {dict(state)}")
        mine = self.state_dict()
        for key in _CONFIG_KEYS:
            if key in state and state[key] != mine[key]:
                raise DataError(
                    f"TokenLoader state was saved with {key}={state[key]}, this loader has "
                    f"{key}={mine[key]}{_WHY.get(key, '')}: build the loader with the saved "
                    "config and data, or start the data order afresh instead of loading the state"
                )
        epoch = state["step"] * self._global_batch_size // self._num_windows
        if state["epoch"] != epoch:
            raise DataError(
                f"TokenLoader state is inconsistent: step={state['step']} is in epoch {epoch}, "
                f"but it says epoch={state['epoch']}; pass an unmodified state_dict()"
            )
        self._step = state["step"]
