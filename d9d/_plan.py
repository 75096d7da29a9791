"""Sharding plans: per param, how it is stored and how it is used, and why."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from ._activations import ActivationLayout
from ._materialize import coalescible, gather, gather_many
from ._module import Axes
from ._pipeline_run import PipelineLayout
from ._sequence_split import SequenceSplit
from .errors import PlanError

__all__ = ["ParamPlan", "Plan"]


@dataclass(frozen=True)
class ParamPlan:
    """The layout of one param on the mesh.

    Attributes:
        path: The param's path.
        shape: Its global shape.
        dtype: Its dtype.
        axes: Its logical axis names (``None`` when unknown).
        storage: Placement per mesh axis of the param, its grad and its optimizer state.
        compute: Placement per mesh axis while a block uses it.
        grad: Placement per mesh axis of the grad where it is computed (``Partial`` on the
            data-parallel axes: each rank holds the grad of its own batch).
        reasons: One line per transform that set a placement, for ``Plan.explain``.
        compute_dtype: The dtype blocks compute with (None: the param's own).
        reduce_dtype: The dtype its grad is reduced in (None: the param's own).
        stages: The pipeline stages holding it (empty without ``pipeline``).
    """

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    axes: Axes | None
    storage: tuple[Placement, ...]
    compute: tuple[Placement, ...]
    grad: tuple[Placement, ...]
    reasons: tuple[str, ...] = ()
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    stages: tuple[int, ...] = ()

    def with_axis(
        self, index: int, *, storage: Placement, compute: Placement, grad: Placement, reason: str
    ) -> ParamPlan:
        """A copy with mesh axis ``index`` set to the given placements and ``reason`` added."""
        return replace(
            self,
            storage=_set(self.storage, index, storage),
            compute=_set(self.compute, index, compute),
            grad=_set(self.grad, index, grad),
            reasons=(*self.reasons, reason),
        )

    def local_shape(
        self, mesh: DeviceMesh, placements: tuple[Placement, ...] | None = None
    ) -> tuple[int, ...]:
        """The largest local shape over ranks (a padded shard) for ``placements`` (storage)."""
        shape = list(self.shape)
        for size, placement in zip(mesh.shape, placements or self.storage, strict=True):
            if isinstance(placement, Shard):
                shape[placement.dim] = math.ceil(shape[placement.dim] / size)
        return tuple(shape)

    def bytes_per_rank(self, mesh: DeviceMesh) -> int:
        """Bytes of the largest stored shard on one rank."""
        return math.prod(self.local_shape(mesh)) * self.dtype.itemsize

    def padding_bytes(self, mesh: DeviceMesh) -> int:
        """Bytes all ranks together store beyond the param's size when shards are uneven."""
        copies = math.prod(
            size
            for size, p in zip(mesh.shape, self.storage, strict=True)
            if not isinstance(p, Shard)
        )
        total = math.prod(self.shape) * self.dtype.itemsize * copies
        return self.bytes_per_rank(mesh) * mesh.size() - total


def _set(placements: tuple[Placement, ...], index: int, value: Placement) -> tuple[Placement, ...]:
    return (*placements[:index], value, *placements[index + 1 :])


def _short(placements: tuple[Placement, ...], names: tuple[str, ...]) -> str:
    parts = []
    for name, p in zip(names, placements, strict=True):
        match p:
            case Replicate():
                continue
            case Shard(dim=dim):
                parts.append(f"{name}:S({dim})")
            case Partial():
                parts.append(f"{name}:P")
            case _:
                parts.append(f"{name}:{p}")
    return " ".join(parts) or "R"


@dataclass
class Plan:
    """Where every param lives on a mesh: a table, per-rank bytes, and the reasons.

    ``print(plan)`` shows path, global shape, storage and compute placements (``R``: replicated
    on every axis; ``fsdp:S(0)``: dim 0 sharded over ``fsdp``) and bytes per rank.
    ``gathers`` says whether any param is computed in another layout than it is stored (only
    then is there anything to free after the forward and gather again for the backward).
    Under ``pipeline`` the plan lists every param with its stages, lays them out on the mesh
    of one stage (``pipeline.stage_mesh``: the mesh without the pipeline axis), and ``held``
    names the ones this rank stores. ``token_groups`` holds ``(group name, ranks)`` of each
    axis over which ranks hold different tokens, for losses' token counts.
    """

    mesh: DeviceMesh
    entries: dict[str, ParamPlan]
    transforms: tuple[Any, ...] = ()
    reshard_after_forward: bool = True
    microbatches: int = 1
    activations: ActivationLayout | None = None
    sequence_split: SequenceSplit | None = None
    pipeline: PipelineLayout | None = None
    token_groups: tuple[tuple[str, int], ...] = ()
    _names: tuple[str, ...] = field(init=False, repr=False)
    gathers: bool = field(init=False, repr=False)
    group_names: tuple[str, ...] = field(init=False, repr=False)
    held: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._names = tuple(self.mesh.mesh_dim_names or ())
        self.held = self.pipeline.held if self.pipeline is not None else tuple(self.entries)
        self.gathers = any(self.entries[p].compute != self.entries[p].storage for p in self.held)
        self.group_names = tuple(self.mesh.get_group(i).group_name for i in range(self.mesh.ndim))

    def __getitem__(self, path: str) -> ParamPlan:
        try:
            return self.entries[path]
        except KeyError:
            raise PlanError(
                f"no param {path!r} in the plan; paths look like {list(self.entries)[:4]}"
            ) from None

    def bytes_per_rank(self) -> int:
        """Param bytes stored on this rank (largest shards; its stages' under ``pipeline``)."""
        return sum(self.entries[p].bytes_per_rank(self.mesh) for p in self.held)

    def padding_bytes(self) -> int:
        """Param bytes stored beyond the model's size over the ranks of one stage (all ranks
        without ``pipeline``), from uneven shards."""
        return sum(e.padding_bytes(self.mesh) for e in self.entries.values())

    def total_bytes(self) -> int:
        """Bytes of the whole unsharded model."""
        return sum(math.prod(e.shape) * e.dtype.itemsize for e in self.entries.values())

    def table(self, *, max_rows: int | None = None) -> str:
        """The plan as a text table; ``max_rows`` elides the middle of long plans.

        Under ``pipeline`` a ``stage`` column gives each param's stages, the mesh is a
        stage's, and the total counts this rank's params."""
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self._names, self.mesh.shape, strict=True))
        title = f"d9d plan on mesh {mesh} ({self.mesh.device_type})"
        if self.pipeline is not None:
            p = self.pipeline
            title += f", one of {p.split.count} stages over {p.axis}={p.size} ({p.schedule})"
        table = Table(title=title, title_justify="left")
        columns = ["path", "shape", "dtype", "storage", "compute", "bytes/rank"]
        if self.pipeline is not None:
            columns.insert(1, "stage")
        for column in columns:
            table.add_column(column, justify="right" if column == "bytes/rank" else "left")
        entries = list(self.entries.values())
        if max_rows is not None and len(entries) > max_rows:
            entries = [*entries[: max_rows // 2], None, *entries[-(max_rows // 2) :]]
        for e in entries:
            if e is None:
                table.add_row("...", *[""] * (len(columns) - 1))
                continue
            row = [
                e.path,
                str(list(e.shape)),
                str(e.dtype).removeprefix("torch."),
                _short(e.storage, self._names),
                _short(e.compute, self._names),
                f"{e.bytes_per_rank(self.mesh):,}",
            ]
            if self.pipeline is not None:
                row.insert(1, ",".join(str(s) for s in e.stages))
            table.add_row(*row)
        table.add_section()
        count = (
            f"{len(self.held)} of {len(self.entries)} params held here"
            if self.pipeline
            else f"{len(self.entries)} params"
        )
        table.add_row(count, *[""] * (len(columns) - 2), f"{self.bytes_per_rank():,}")
        table.caption = (
            f"unsharded model {self.total_bytes():,} B; padding from uneven shards "
            f"{self.padding_bytes():,} B over all ranks"
        )
        table.caption_justify = "left"
        console = Console(width=140, record=True, file=_Null())
        console.print(table)
        return console.export_text()

    def __str__(self) -> str:
        return self.table()

    def explain(self, path: str) -> str:
        """Why param ``path`` got its placements, one line per deciding transform."""
        e = self[path]
        lines = [
            f"{e.path}: shape {list(e.shape)} {str(e.dtype).removeprefix('torch.')}, logical axes {e.axes}",
            f"  stored   {_short(e.storage, self._names)} ({e.bytes_per_rank(self.mesh):,} B per rank)",
            f"  computed {_short(e.compute, self._names)}"
            + (f" in {str(e.compute_dtype).removeprefix('torch.')}" if e.compute_dtype else "")
            + (
                f", grads reduced in {str(e.reduce_dtype).removeprefix('torch.')}"
                if e.reduce_dtype
                else ""
            ),
        ]
        lines += [f"  - {reason}" for reason in e.reasons] or [
            "  - no transform places it: replicated"
        ]
        return "\n".join(lines)

    def materialize(self, path: str, stored: torch.Tensor) -> torch.Tensor:
        """The tensor a block computes with: ``stored`` gathered to its compute placement.

        Its gradient, ``Partial`` on the data-parallel axes (each rank's own batch), is
        reduced back to the storage placement in the backward: first over the axes the param
        is sharded on (a reduce-scatter), then over the axes it is replicated on (an
        all-reduce of the shard, not of the whole grad).
        """
        if not isinstance(stored, DTensor):
            raise PlanError(
                f"param {path!r} is a plain tensor but the step is placed on a mesh; pass the "
                "params returned by step.place(params, opt_state)"
            )
        e = self.entries[path]
        return gather(
            stored,
            self.mesh,
            e.compute,
            e.grad,
            compute_dtype=e.compute_dtype,
            reduce_dtype=e.reduce_dtype,
        )

    def materialize_many(self, paths: list[str], params: Any) -> dict[str, torch.Tensor]:
        """:meth:`materialize` of several params, with one collective per group of params
        gathered alike (one mesh axis, same dtypes and grad layout): a block's params are
        all-gathered together and their grads reduce-scattered together, as FSDP2 does."""
        groups: dict[tuple, list[str]] = {}
        out: dict[str, torch.Tensor] = {}
        for path in paths:
            e = self.entries[path]
            found = coalescible(e) if isinstance(params[path], DTensor) else None
            if found is None:
                out[path] = self.materialize(path, params[path])
                continue
            axis = found[0]
            key = (axis, e.compute_dtype or e.dtype, e.reduce_dtype or e.dtype, e.grad[axis])
            groups.setdefault(key, []).append(path)
        for (axis, *_), members in groups.items():
            if len(members) == 1:
                out[members[0]] = self.materialize(members[0], params[members[0]])
                continue
            stored = [params[p] for p in members]
            entries = [self.entries[p] for p in members]
            gathered = gather_many(stored, self.mesh, entries, axis, self.group_names[axis])
            out.update(zip(members, gathered, strict=True))
        return {p: out[p] for p in paths}


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
