"""A plan as text: the table of every param and the reasons behind one param's layout."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

__all__ = [
    "annotation_cell",
    "annotation_columns",
    "render_explanation",
    "render_table",
    "short_placements",
]


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


def render_table(plan: Any, *, max_rows: int | None = None) -> str:
    """The text table of :meth:`d9d.transforms.Plan.table` (``plan``: a ``Plan``; this module
    prints plans and imports none)."""
    from rich.console import Console  # rich only when a plan is printed
    from rich.table import Table

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


def annotation_columns(entries: Any) -> list[type]:
    """The kinds of annotation among ``entries`` (plans of params) that are table columns
    (a ``column`` name and a ``cell()``), in order of first appearance."""
    kinds: dict[type, None] = {}
    for entry in entries:
        for annotation in entry.annotations:
            if hasattr(type(annotation), "column"):
                kinds.setdefault(type(annotation), None)
    return list(kinds)


def annotation_cell(entry: Any, kind: type) -> str:
    """``entry``'s cell in the column of annotation ``kind`` (empty without one)."""
    annotation = entry.annotation(kind)
    return "" if annotation is None else annotation.cell()


def render_explanation(plan: Any, path: str) -> str:
    """The text of :meth:`d9d.transforms.Plan.explain`."""
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
