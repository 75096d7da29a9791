"""Reading each rank's shards of params straight from a safetensors folder.

A param's local shard is a box of its global tensor (``_layout.local_box``). Every stored
tensor it comes from is opened lazily (``safe_open(...).get_slice(key)[...]``, an mmap of
the file) and only the box's elements are copied into the shard; the file is closed after
each tensor, so the pages it mapped leave the process. A rank's peak memory is then its
own shards plus one stored tensor's slice, not the model (``benchmarks/hf_stream.py``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import tree as tree_lib
from ..errors import CheckpointCorruptError, ParamShapeError, ParamTreeMismatchError
from ._layout import box_slices
from ._restore import as_leaf, leaf_box, want_of

__all__ = [
    "Concatenated",
    "Source",
    "Stored",
    "load_whole",
    "open_safetensors",
    "read_placed",
    "refuse_unconverted",
    "safetensors_files",
    "stored_keys",
    "weight_files",
]

RECOMPUTED = re.compile(r"\.rotary_emb\.inv_freq$")


def ignored_on_load(path: str | os.PathLike[str]) -> tuple[re.Pattern[str], ...]:
    """The patterns of stored tensors that ``transformers`` itself skips when it loads the
    folder's model: its class's ``_keys_to_ignore_on_load_unexpected`` (DeepSeek-V3's
    multi-token-prediction layer ``model.layers.61``, the ``attn.bias`` masks old GPT-2
    checkpoints hold), by the ``architectures`` of its ``config.json``; none without one."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
        import transformers
    except (OSError, ValueError, ImportError):
        return ()
    names = config.get("architectures") if isinstance(config, dict) else None
    patterns: list[str] = []
    for name in names if isinstance(names, list) else []:
        model_class = getattr(transformers, str(name), None)
        patterns += getattr(model_class, "_keys_to_ignore_on_load_unexpected", None) or []
    return tuple(re.compile(pattern) for pattern in patterns)


"""Non-weights some older Hugging Face checkpoints hold; d9d's models recompute them."""


@dataclass(frozen=True)
class Stored:
    """Where a param's values lie among the stored tensors of a safetensors folder.

    Attributes:
        keys: One stored tensor, or with ``stacked`` one per index of the param's dim 0;
            empty for a param that is not stored (it is read as zeros).
        stacked: The param stacks ``keys`` along a new dim 0 (per-expert weights).
        transposed: The param holds each stored tensor with its last two dims swapped.
        start: Where the param begins inside the (per-index) stored tensor, in the stored
            tensor's coordinates; zeros when it is the whole tensor, else a part of a
            merged one (``gate_up_proj``).
    """

    keys: tuple[str, ...]
    stacked: bool = False
    transposed: bool = False
    start: tuple[int, ...] = ()

    def stored_box(
        self, offset: Sequence[int], shape: Sequence[int]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The box of one stored tensor that the param's box ``(offset, shape)`` reads (for a
        stacked param, the box without its dim 0)."""
        offset, shape = list(offset), list(shape)
        if self.transposed:
            offset[-2:], shape[-2:] = offset[:-3:-1], shape[:-3:-1]
        start = self.start or (0,) * len(offset)
        return tuple(o + s for o, s in zip(offset, start, strict=True)), tuple(shape)

    def stored_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The smallest stored shape (per stacked index) a param of global ``shape`` needs."""
        offset, extent = self.stored_box(
            (0,) * (len(shape) - int(self.stacked)), shape[int(self.stacked) :]
        )
        return tuple(o + n for o, n in zip(offset, extent, strict=True))


@dataclass(frozen=True)
class Concatenated:
    """A param made of ``parts`` laid end to end along its dim ``dim`` (a fused weight stored
    as its pieces, e.g. ``experts.gate_up_proj`` from per-expert ``gate_proj``/``up_proj``).

    Attributes:
        dim: The param's dim the parts follow each other along.
        parts: ``(size along dim, Stored)`` of each part, in order.
    """

    dim: int
    parts: tuple[tuple[int, Stored], ...]

    def pieces(
        self, offset: Sequence[int], shape: Sequence[int]
    ) -> list[tuple[Stored, tuple[int, ...], tuple[int, ...], int, int]]:
        """``(part, its box, where it starts in the box along dim, its length)`` of each part
        the box ``(offset, shape)`` of the param overlaps."""
        out, begin = [], 0
        lo, hi = offset[self.dim], offset[self.dim] + shape[self.dim]
        for size, part in self.parts:
            first, last = max(lo, begin), min(hi, begin + size)
            if first < last:
                part_offset = [*offset[: self.dim], first - begin, *offset[self.dim + 1 :]]
                part_shape = [*shape[: self.dim], last - first, *shape[self.dim + 1 :]]
                out.append((part, tuple(part_offset), tuple(part_shape), first - lo, last - first))
            begin += size
        return out


Source = Stored | Concatenated
"""Where a param's values lie: one stored tensor (or stack of them), or parts of it."""


def weight_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a folder: ``model.safetensors``, or every file that
    ``model.safetensors.index.json`` lists.

    Raises:
        FileNotFoundError: A weights file is missing.
        CheckpointCorruptError: The index is not JSON or has no ``weight_map`` of file names.
    """
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        names = ["model.safetensors"]
    else:
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointCorruptError(
                f"{str(index)!r} is not a safetensors index (a JSON object whose "
                f"'weight_map' maps each tensor to its file name): {error!r}; the folder is "
                "damaged: fetch it again."
            ) from error
    files = [path / name for name in names]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{str(file)!r} is missing; the folder is incomplete.")
    return files


@contextlib.contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """``safe_open(file)``, its header checked: a truncated or garbled file is named.

    Raises:
        CheckpointCorruptError: ``file`` is not a readable safetensors file.
    """
    from safetensors import SafetensorError, safe_open

    try:
        opened = safe_open(str(file), framework="pt")
    except SafetensorError as error:
        raise CheckpointCorruptError(
            f"{str(file)!r} is not a readable safetensors file ({error}); the folder is "
            "damaged (a truncated or interrupted download?): fetch that file again."
        ) from error
    with opened:
        yield opened


def safetensors_files(path: str | os.PathLike[str]) -> dict[str, Path]:
    """``{stored key: file}`` of a folder's ``model.safetensors`` or of the files that
    ``model.safetensors.index.json`` lists (headers only are read).

    Raises:
        FileNotFoundError: A weights file is missing.
        CheckpointCorruptError: A file or the index is damaged, or two files hold one key.
    """
    files: dict[str, Path] = {}
    for file in weight_files(path):
        with open_safetensors(file) as opened:
            keys = opened.keys()  # safe_open is not iterable
            for key in keys:
                if key in files:
                    raise CheckpointCorruptError(
                        f"Stored tensor {key!r} is in both {str(files[key])!r} and "
                        f"{str(file)!r}; the folder's files overlap: fetch it again."
                    )
                files[key] = file
    return files


def load_whole(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every stored tensor of a safetensors folder, whole (for a full import).

    Raises:
        FileNotFoundError: A weights file is missing.
        CheckpointCorruptError: A file or the index is damaged, or two files hold one key.
    """
    by_file: dict[Path, list[str]] = {}
    for key, file in safetensors_files(path).items():
        by_file.setdefault(file, []).append(key)
    state = {}
    for file, keys in by_file.items():
        with open_safetensors(file) as opened:
            state.update({key: opened.get_tensor(key) for key in keys})
    return state


def stored_keys(source: Source) -> tuple[str, ...]:
    """Every stored key ``source`` reads."""
    match source:
        case Stored(keys=keys):
            return keys
        case Concatenated(parts=parts):
            return tuple(key for _, part in parts for key in part.keys)
        case _:
            raise TypeError(f"A source is a Stored or a Concatenated, got {source!r}.")


def refuse_unconverted(
    stored: Iterable[str], sources: Mapping[str, Source], model: str, also: Iterable[str] = ()
) -> None:
    """Raise unless every ``stored`` key is read by one of ``sources`` (every param of the
    model, not only a target's), is in ``also``, or is a ``rotary_emb.inv_freq`` buffer.

    Raises:
        ParamTreeMismatchError: Naming the stored tensors ``model`` has no param for, which
            an import would otherwise drop.
    """
    read = {key for source in sources.values() for key in stored_keys(source)} | set(also)
    unknown = sorted(k for k in stored if k not in read and not RECOMPUTED.search(k))
    if unknown:
        raise ParamTreeMismatchError(
            f"Stored tensors {unknown[:10]} ({len(unknown)} in all) have no param in {model}, "
            "so importing would drop them: the folder is not a model of the layout d9d "
            "converts. Train the transformers model itself instead: "
            "d9d.functionalize(AutoModelForCausalLM.from_pretrained(folder))."
        )


def _shapes(files: Mapping[str, Path], keys: set[str]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in sorted({files[k] for k in keys}):
        with open_safetensors(file) as opened:
            mine = keys.intersection(opened.keys())
            shapes.update({k: tuple(opened.get_slice(k).get_shape()) for k in mine})
    return shapes


def _parts(source: Source, shape: tuple[int, ...]) -> list[tuple[Stored, tuple[int, ...]]]:
    """Each stored source of a param of global ``shape``, with the shape of what it covers."""
    match source:
        case Stored():
            return [(source, shape)]
        case Concatenated(dim=dim, parts=parts):
            return [(part, (*shape[:dim], size, *shape[dim + 1 :])) for size, part in parts]
        case _:
            raise TypeError(f"A source is a Stored or a Concatenated, got {source!r}.")


def _check(
    wants: Mapping[str, Any], sources: Mapping[str, Source], files: Mapping[str, Path]
) -> None:
    """Raise unless every wanted param has a source whose stored tensors exist and fit."""
    values = sorted(path for path, want in wants.items() if want.layout is None)
    if values:
        raise TypeError(
            f"Target leaves {values[:10]} are Python values; a safetensors folder holds "
            "tensors only: give tensors, DTensors or Abstract leaves."
        )
    unmapped = sorted(set(wants) - set(sources))
    parts = {p: _parts(sources[p], w.layout.shape) for p, w in wants.items() if p in sources}
    keys = {k for found in parts.values() for part, _ in found for k in part.keys}
    absent = sorted(keys - set(files))
    if unmapped or absent:
        raise ParamTreeMismatchError(
            f"The safetensors folder lacks weights of the target: stored tensors {absent[:10]} "
            f"are missing; target params {unmapped[:10]} have no stored source."
        )
    shapes = _shapes(files, keys)
    for path, found in parts.items():
        global_shape = wants[path].layout.shape
        source = sources[path]
        if (
            isinstance(source, Concatenated)
            and sum(n for n, _ in source.parts) != global_shape[source.dim]
        ):
            raise ParamShapeError(
                f"Param {path!r} of shape {global_shape} is concatenated from parts of sizes "
                f"{[n for n, _ in source.parts]} along dim {source.dim}, which do not add up."
            )
        for part, covered in found:
            _check_part(path, global_shape, part, covered, shapes, files)


def _check_part(
    path: str,
    global_shape: tuple[int, ...],
    part: Stored,
    covered: tuple[int, ...],
    shapes: Mapping[str, tuple[int, ...]],
    files: Mapping[str, Path],
) -> None:
    if not part.keys:
        return
    needed = part.stored_shape(covered)
    for key in part.keys:
        got = shapes[key]
        # A part of a merged tensor (``start``) fits in a larger one; a whole one must match.
        fits = len(got) == len(needed) and all(
            g >= n if part.start else g == n for g, n in zip(got, needed, strict=True)
        )
        if not fits:
            raise ParamShapeError(
                f"Param {path!r} of shape {global_shape} needs stored tensor {key!r} of "
                f"shape {needed}, but it has shape {got} in {str(files[key])!r}; the folder "
                "is not the model of this config."
            )
    expected_count = covered[0] if part.stacked else 1
    if len(part.keys) != expected_count:
        raise ParamShapeError(
            f"Param {path!r} of shape {global_shape} stacks {expected_count} stored "
            f"tensors, but its source lists {len(part.keys)}."
        )


def _read_source(
    source: Source,
    files: Mapping[str, Path],
    box: tuple[tuple[int, ...], tuple[int, ...]],
    out: torch.Tensor,
) -> None:
    """Fill ``out``, the param's ``box``, from ``source``."""
    match source:
        case Stored(keys=()):
            out.zero_()
        case Stored():
            _read_box(source, files, box, out)
        case Concatenated(dim=dim):
            for part, offset, shape, start, length in source.pieces(*box):
                _read_box(part, files, (offset, shape), out.narrow(dim, start, length))
        case _:
            raise TypeError(f"A source is a Stored or a Concatenated, got {source!r}.")


def _read_box(
    source: Stored,
    files: Mapping[str, Path],
    box: tuple[tuple[int, ...], tuple[int, ...]],
    out: torch.Tensor,
) -> None:
    """Copy the param's ``box`` from the stored tensors into ``out`` (its local shard)."""
    offset, shape = box
    if source.stacked:
        pieces = [
            (source.keys[offset[0] + i], out[i], offset[1:], shape[1:]) for i in range(shape[0])
        ]
    else:
        pieces = [(source.keys[0], out, offset, shape)]
    for key, target, piece_offset, piece_shape in pieces:
        stored_offset, stored_shape = source.stored_box(piece_offset, piece_shape)
        # One open per tensor: the mmap (and the pages the copy faulted in) goes with it.
        with open_safetensors(files[key]) as opened:
            stored = opened.get_slice(key)
            view = (
                stored[box_slices(stored_offset, stored_shape)]
                if piece_shape
                else opened.get_tensor(key)
            )
            target.copy_(view.transpose(-1, -2) if source.transposed else view)
            del view, stored


def read_placed(path: str | os.PathLike[str], target: Any, sources: Mapping[str, Source]) -> Any:
    """Each rank's shards of ``target``'s params, read from the safetensors folder ``path``.

    Args:
        path: A folder of ``model.safetensors`` or an indexed set of safetensors files.
        target: ``{param path: leaf}``, leaves as :func:`d9d.checkpoint.restore` takes them
            (meta DTensors from ``step.place`` of meta params, tensors, ``Abstract``).
        sources: ``{param path: Stored or Concatenated}`` for every path of ``target``.

    Returns:
        A tree of ``target``'s structure: DTensors holding this rank's shards, or tensors,
        in the target's dtypes (stored values are cast when the dtype differs).
    """
    leaves, spec = tree_lib.flatten_with_paths(target)
    wants = {leaf_path: want_of(leaf_path, leaf) for leaf_path, leaf in leaves}
    files = safetensors_files(path)
    _check(wants, sources, files)
    out = {}
    for leaf_path, want in wants.items():
        box = leaf_box(want, leaf_path)
        local = torch.empty(box[1], dtype=want.layout.dtype)
        if math.prod(box[1]):
            _read_source(sources[leaf_path], files, box, local)
        out[leaf_path] = as_leaf(local, want)
    return tree_lib.unflatten(spec, [out[leaf_path] for leaf_path, _ in leaves])
