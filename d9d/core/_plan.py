"""The plan of a step: every param's plan on a mesh, what the step's ranks share, and the
plan as text (the table of every param, the reasons behind one param's layout)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ..errors import PlanError
from ._param_plan import ParamPlan

__all__ = [
    "Plan",
    "annotation_cell",
    "annotation_columns",
    "render_explanation",
    "render_table",
    "short_placements",
]


@dataclass
class Plan:
    """Where every param lives on a mesh: per-param plans, and what the step's ranks share.

    ``print(plan)`` shows path, global shape, storage and compute placements (``R``: replicated
    on every axis; ``fsdp:S(0)``: dim 0 sharded over ``fsdp``) and bytes per rank;
    ``plan.explain(path)`` says why. Under ``pipeline`` the plan lists every param with its
    stages, lays them out on the mesh of one stage (the mesh without the pipeline axis), and
    ``held`` names the ones this rank stores.

    Attributes:
        mesh: The mesh the params are laid out on.
        entries: ``{path: ParamPlan}`` of every param of the model.
        held: Paths of the params this rank stores (default: all).
        token_groups: ``(process group name, ranks)`` of each axis over which ranks hold
            different tokens, over which losses count their tokens.
        stage_group: The process group over which ranks hold different params whole (the
            pipeline axis), over which norms of the whole model are summed; None.
        notes: Lines the plan's title adds (e.g. which stage of how many).
        state_bytes: Bytes of optimizer state this rank holds, per dtype name
            (``{"bfloat16": ..., "int64": ...}``), from the tree ``step.place`` laid out;
            empty before.
    """

    mesh: DeviceMesh
    entries: dict[str, ParamPlan]
    held: tuple[str, ...] | None = None
    token_groups: tuple[tuple[str, int], ...] = ()
    stage_group: str | None = None
    notes: tuple[str, ...] = ()
    state_bytes: dict[str, int] = field(default_factory=dict)
    names: tuple[str, ...] = field(init=False, repr=False)
    group_names: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.held is None:
            self.held = tuple(self.entries)
        self.names = tuple(self.mesh.mesh_dim_names or ())
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
        return render_table(self, max_rows=max_rows)

    def __str__(self) -> str:
        return self.table()

    def explain(self, path: str) -> str:
        """Why param ``path`` got its placements, one line per deciding transform."""
        return render_explanation(self, path)


def short_placements(placements: tuple[Placement, ...], names: tuple[str, ...]) -> str:
    """``fsdp:S(0) tp:S(1)``: the non-replicated placements by axis name, or ``R``."""
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


def render_table(plan: Plan, *, max_rows: int | None = None) -> str:
    """The text table of :meth:`Plan.table`."""
    names = plan.names
    mesh = " x ".join(f"{n}={s}" for n, s in zip(names, plan.mesh.shape, strict=True))
    title = ", ".join((f"d9d plan on mesh {mesh} ({plan.mesh.device_type})", *plan.notes))
    kinds = annotation_columns(plan.entries.values())
    table = Table(title=title, title_justify="left")
    columns = ["path", *(k.column for k in kinds), "shape", "dtype", "storage", "compute"]
    columns.append("bytes/rank")
    for column in columns:
        table.add_column(column, justify="right" if column == "bytes/rank" else "left")
    entries = list(plan.entries.values())
    if max_rows is not None and len(entries) > max_rows:
        entries = [*entries[: max_rows // 2], None, *entries[-(max_rows // 2) :]]
    for e in entries:
        if e is None:
            table.add_row("...", *[""] * (len(columns) - 1))
            continue
        row = [
            e.path,
            *(annotation_cell(e, kind) for kind in kinds),
            str(list(e.shape)),
            str(e.dtype).removeprefix("torch."),
            short_placements(e.storage, names),
            short_placements(e.compute, names),
            f"{e.bytes_per_rank(plan.mesh):,}",
        ]
        table.add_row(*row)
    table.add_section()
    held = len(plan.held)
    count = (
        f"{held} of {len(plan.entries)} params held here"
        if held < len(plan.entries) or plan.stage_group is not None
        else f"{len(plan.entries)} params"
    )
    table.add_row(count, *[""] * (len(columns) - 2), f"{plan.bytes_per_rank():,}")
    table.caption = (
        f"unsharded model {plan.total_bytes():,} B; padding from uneven shards "
        f"{plan.padding_bytes():,} B over all ranks"
    )
    if plan.state_bytes:
        by_dtype = ", ".join(f"{dtype} {n:,} B" for dtype, n in plan.state_bytes.items())
        table.caption += (
            f"\noptimizer state {sum(plan.state_bytes.values()):,} B on this rank: {by_dtype}"
        )
    table.caption_justify = "left"
    console = Console(width=140, record=True, file=_Null())
    console.print(table)
    return console.export_text()


def annotation_columns(entries: Iterable[ParamPlan]) -> list[type]:
    """The kinds of annotation among ``entries`` (plans of params) that are table columns
    (a ``column`` name and a ``cell()``), in order of first appearance."""
    kinds: dict[type, None] = {}
    for entry in entries:
        for annotation in entry.annotations:
            if hasattr(type(annotation), "column"):
                kinds.setdefault(type(annotation), None)
    return list(kinds)


def annotation_cell(entry: ParamPlan, kind: type) -> str:
    """``entry``'s cell in the column of annotation ``kind`` (empty without one)."""
    annotation = entry.annotation(kind)
    return "" if annotation is None else annotation.cell()


def render_explanation(plan: Plan, path: str) -> str:
    """The text of :meth:`Plan.explain`."""
    e = plan[path]
    names = plan.names
    lines = [
        f"{e.path}: shape {list(e.shape)} {str(e.dtype).removeprefix('torch.')}, logical axes {e.axes}",
        f"  stored   {short_placements(e.storage, names)} ({e.bytes_per_rank(plan.mesh):,} B per rank)",
        f"  computed {short_placements(e.compute, names)}"
        + (f" in {str(e.compute_dtype).removeprefix('torch.')}" if e.compute_dtype else "")
        + (
            f", grads reduced in {str(e.reduce_dtype).removeprefix('torch.')}"
            if e.reduce_dtype
            else ""
        ),
    ]
    lines += [f"  - {reason}" for reason in e.reasons] or ["  - no transform places it: replicated"]
    return "\n".join(lines)


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
