"""``restore``: read a checkpoint into the layout of a target tree, each rank only its slices."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from .. import tree as tree_lib
from ..core._state_device import kept_on
from ..errors import CheckpointCorruptError, CheckpointMismatchError
from . import _format
from ._chunk_read import check_array, read_box
from ._layout import (
    Layout,
    brief,
    check_placements,
    dtype_from_name,
    local_box,
)

__all__ = ["Abstract", "as_leaf", "leaf_box", "restore", "want_of"]

_VALUES = (bool, int, float, str)
_MAX_LISTED = 20


@dataclass(frozen=True)
class Abstract:
    """A leaf to restore, described without data: global shape, dtype, optional sharding.

    Restored as a plain CPU tensor without ``mesh``, or as a DTensor on ``mesh`` (on its
    device type) with ``placements`` (``Shard``/``Replicate``, one per mesh axis).

    Args:
        shape: Global shape.
        dtype: Torch dtype.
        mesh: Device mesh of the restored DTensor, or ``None`` for a plain tensor.
        placements: One placement per mesh axis; required with ``mesh``.

    Raises:
        ValueError: A dim is negative, or ``placements`` does not fit ``mesh`` and ``shape``.
        TypeError: ``dtype`` is not a ``torch.dtype``.

    Example:
        >>> Abstract((4, 2), torch.float32)
        Abstract(shape=(4, 2), dtype=torch.float32, mesh=None, placements=None)
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: DeviceMesh | None = None
    placements: tuple[Placement, ...] | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise ValueError(f"Abstract shape must be ints >= 0, got shape={self.shape!r}.")
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"Abstract dtype must be a torch.dtype, got dtype={self.dtype!r}.")
        if (self.mesh is None) != (self.placements is None):
            raise ValueError(
                "Abstract takes mesh and placements together (a DTensor) or neither (a plain "
                f"tensor); got mesh={self.mesh!r}, placements={self.placements!r}."
            )
        if self.mesh is not None:
            placements = tuple(self.placements or ())
            if len(placements) != self.mesh.ndim:
                raise ValueError(
                    f"Abstract needs one placement per mesh axis: the mesh has {self.mesh.ndim} "
                    f"axes {self.mesh.mesh_dim_names}, got placements={placements!r}."
                )
            check_placements("Abstract", placements, len(shape))
            object.__setattr__(self, "placements", placements)

    @classmethod
    def like(cls, leaf: torch.Tensor) -> Abstract:
        """The abstract leaf of a tensor or DTensor (its mesh and placements kept).

        Example:
            >>> Abstract.like(torch.zeros(3, dtype=torch.int8)).shape
            (3,)
        """
        if isinstance(leaf, DTensor):
            return cls(tuple(leaf.shape), leaf.dtype, leaf.device_mesh, tuple(leaf.placements))
        return cls(tuple(leaf.shape), leaf.dtype)


@dataclass(frozen=True)
class _Want:
    """What the target asks for at one path: a Python value, or an array layout on a device."""

    layout: Layout | None
    device: torch.device | None
    value_type: type | None = None


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def want_of(path: str, leaf: Any) -> _Want:
    """What the target leaf at ``path`` asks for."""
    match leaf:
        case DTensor():
            check_placements(path, leaf.placements, leaf.ndim)
            local = leaf.to_local().device
            device = _mesh_device(leaf.device_mesh) if local.type == "meta" else local
            mesh, placements = leaf.device_mesh, tuple(leaf.placements)
            return _Want(Layout(tuple(leaf.shape), leaf.dtype, mesh, placements), device)
        case torch.Tensor():
            device = torch.device("cpu") if leaf.device.type == "meta" else leaf.device
            return _Want(Layout(tuple(leaf.shape), leaf.dtype), device)
        case Abstract(mesh=None):
            return _Want(Layout(leaf.shape, leaf.dtype), torch.device("cpu"))
        case Abstract():
            layout = Layout(leaf.shape, leaf.dtype, leaf.mesh, leaf.placements)
            return _Want(layout, _mesh_device(leaf.mesh))
        case bool() | int() | float() | str():
            return _Want(None, None, type(leaf))
        case _:
            raise TypeError(
                f"Target leaf {path!r} is a {type(leaf).__name__}; targets hold tensors, "
                "DTensors, d9d.checkpoint.Abstract leaves and bool/int/float/str values."
            )


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _problem(path: str, want: _Want, record: dict[str, Any]) -> str | None:
    """Why the saved ``record`` cannot fill ``want``, or ``None``."""
    saved = "array" if record["kind"] == "array" else type(record["value"]).__name__
    wanted = "tensor" if want.value_type is None else want.value_type.__name__
    if (saved == "array") != (wanted == "tensor") or (wanted != "tensor" and saved != wanted):
        return f"{path!r}: {_a(saved)} in the checkpoint, {_a(wanted)} in the target"
    if want.layout is None:
        return None
    shape, dtype = tuple(record["shape"]), record["dtype"]
    target_dtype = str(want.layout.dtype).removeprefix("torch.")
    if shape != want.layout.shape:
        return f"{path!r}: shape {shape} in the checkpoint, {want.layout.shape} in the target"
    if dtype != target_dtype:
        return f"{path!r}: dtype {dtype} in the checkpoint, {target_dtype} in the target"
    return None


def _validate(path: Path, saved: dict[str, Any], wants: dict[str, _Want], partial: bool) -> None:
    problems = [p for k, w in wants.items() if k in saved and (p := _problem(k, w, saved[k]))]
    missing = [k for k in wants if k not in saved]
    extra = [] if partial else [k for k in saved if k not in wants]
    if missing:
        problems.append(f"in the target but not in the checkpoint: {missing[:_MAX_LISTED]}")
    if extra:
        problems.append(
            f"in the checkpoint but not in the target: {extra[:_MAX_LISTED]} "
            "(pass partial=True to restore only the target's paths)"
        )
    if problems:
        listed = "\n  ".join(problems[:_MAX_LISTED])
        more = len(problems) - _MAX_LISTED
        raise CheckpointMismatchError(
            f"Checkpoint {str(path)!r} does not match the target (nothing was read):\n  {listed}"
            + (f"\n  ... and {more} more" if more > 0 else "")
        )


def _corrupt(path: Path, leaf: str, exc: BaseException) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"Array of leaf {leaf!r} in checkpoint {str(path)!r} cannot be read: {brief(exc)}. The "
        "checkpoint is damaged (a file is missing, truncated or fails its checksum); "
        "restore an older checkpoint."
    )


def leaf_box(want: _Want, leaf: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box of the global array this rank's piece of the target leaf covers."""
    layout = want.layout
    if layout.mesh is None:
        return (0,) * len(layout.shape), layout.shape
    coordinate = layout.mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(
            f"Target leaf {leaf!r} is on a mesh this rank is not part of; give each rank a "
            "target of only its own leaves (and partial=True)."
        )
    return local_box(layout, coordinate)


def _read(path: Path, saved: dict[str, Any], wants: dict[str, _Want]) -> dict[str, Any]:
    """Check every array's zarr metadata before reading any, then read each box."""
    boxes = {leaf: leaf_box(want, leaf) for leaf, want in wants.items() if want.layout is not None}
    for leaf in boxes:
        try:
            check_array(path, saved[leaf])
        except ValueError as exc:
            raise _corrupt(path, leaf, exc) from None
    out: dict[str, Any] = {}
    for leaf, want in wants.items():
        if want.layout is None:
            out[leaf] = saved[leaf]["value"]
            continue
        box = boxes[leaf]
        if math.prod(box[1]):
            try:
                local = read_box(path, saved[leaf], box, want.layout.dtype)
            except ValueError as exc:
                raise _corrupt(path, leaf, exc) from None
        else:
            local = torch.empty(box[1], dtype=want.layout.dtype)
        out[leaf] = as_leaf(local, want)
    return out


def as_leaf(local: torch.Tensor, want: _Want) -> torch.Tensor:
    """``local`` (this rank's piece, on the CPU) moved to the wanted device, as a DTensor of
    the wanted layout when it has a mesh; a target DTensor whose shard is on another device
    than its mesh's (optimizer state on the host) gets its shard there."""
    local, layout = local.to(want.device), want.layout
    if layout.mesh is None:
        return local
    if local.device.type != layout.mesh.device_type:  # optimizer state kept on the host
        shape = torch.Size(layout.shape)
        stride = torch.empty(layout.shape, device="meta").stride()
        return kept_on(local, layout.mesh, layout.placements, shape, stride)
    return DTensor.from_local(
        local,
        layout.mesh,
        layout.placements,
        run_check=False,
        shape=torch.Size(layout.shape),
        stride=torch.empty(layout.shape, device="meta").stride(),
    )


def restore(path: str | os.PathLike[str], target: Any = None, *, partial: bool = False) -> Any:
    """Read the checkpoint at ``path`` into a new tree laid out like ``target``.

    ``target`` gives, per leaf path, the wanted global shape, dtype and placement: a
    tensor (restored on its device, or the CPU if it is on ``meta``), a DTensor (restored
    as a DTensor on its mesh with its placements), an :class:`Abstract`, or a Python value
    (replaced by the saved value). The layout the checkpoint was saved with does not
    matter: each rank reads exactly the slice its target shard needs, so a checkpoint
    saved under ``fsdp=4`` restores under ``fsdp=2 x tp=2``, ``dp x fsdp`` or one device.
    The whole target is checked against the checkpoint before any data is read, and
    ``target`` itself is never modified. Ranks do not communicate.

    Args:
        path: A committed checkpoint folder (``<directory>/step_<N>``, e.g. from
            :func:`latest`).
        target: The tree to restore into; ``None`` returns every leaf as a plain CPU
            tensor (or value) in a flat ``{path: leaf}`` dict.
        partial: Allow the checkpoint to hold paths the target lacks (they are skipped),
            e.g. a pipeline stage restoring its own layers. Default ``False``.

    Returns:
        A tree of the structure of ``target`` holding new tensors, DTensors and values.

    Raises:
        CheckpointNotFoundError: ``path`` is not a committed checkpoint.
        CheckpointMismatchError: A path is missing or extra, or a shape, dtype or kind
            differs; names each path with both shapes or dtypes.
        CheckpointCorruptError: An array file is missing, truncated or fails its
            checksum; names the leaf path.
        TypeError: A target leaf is not a tensor, DTensor, Abstract or Python value.
        ValueError: A target placement is not ``Shard``/``Replicate``, or a target
            mesh does not include this rank.

    Example:
        >>> import tempfile, torch
        >>> from d9d.checkpoint import save
        >>> ckpt = save(tempfile.mkdtemp(), {"w": torch.arange(4.0)}, step=1).wait()
        >>> restore(ckpt, {"w": torch.empty(4, device="meta")})
        {'w': tensor([0., 1., 2., 3.])}
    """
    path = Path(path)
    saved = _format.metadata(path)["leaves"]
    if target is None:
        wants = {
            k: _Want(Layout(tuple(r["shape"]), dtype_from_name(r["dtype"])), torch.device("cpu"))
            if r["kind"] == "array"
            else _Want(None, None, type(r["value"]))
            for k, r in saved.items()
        }
        return _read(path, saved, wants)
    leaves, spec = tree_lib.flatten_with_paths(target)
    wants = {leaf_path: want_of(leaf_path, leaf) for leaf_path, leaf in leaves}
    _validate(path, saved, wants, partial)
    out = _read(path, saved, wants)
    return tree_lib.unflatten(spec, [out[leaf_path] for leaf_path, _ in leaves])
