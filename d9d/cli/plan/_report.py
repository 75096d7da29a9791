"""``d9d plan``'s text: sizes in binary units, the plan table, memory and collectives."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ...core._comm_count import CommStats
from ...core._plan import Plan, annotation_cell, annotation_columns, short_placements

__all__ = ["human", "render_comms", "render_plan"]

_UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def human(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches: ``human(3 * 2**30) == "3.00 GiB"``."""
    for size, unit in _UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _text(table: Table) -> str:
    console = Console(width=140, record=True, file=_Null())
    console.print(table)
    return console.export_text().rstrip()


def render_plan(plan: Plan, title: str, *, max_rows: int | None) -> str:
    """The table of every param (the middle elided past ``max_rows``) with its bytes per rank."""
    names = plan.names
    kinds = annotation_columns(plan.entries.values())
    table = Table(title=title, title_justify="left")
    columns = ["path", *(k.column for k in kinds), "shape", "dtype", "storage", "compute"]
    for column in (*columns, "per rank"):
        table.add_column(column, justify="right" if column == "per rank" else "left")
    entries: list = list(plan.entries.values())
    if max_rows is not None and len(entries) > max_rows:
        entries = [*entries[: max_rows // 2], None, *entries[-(max_rows // 2) :]]
    for e in entries:
        if e is None:
            table.add_row("...", *[""] * len(columns))
            continue
        table.add_row(
            e.path,
            *(annotation_cell(e, kind) for kind in kinds),
            str(list(e.shape)),
            str(e.dtype).removeprefix("torch."),
            short_placements(e.storage, names),
            short_placements(e.compute, names),
            human(e.bytes_per_rank(plan.mesh) if e.path in plan.held else 0),
        )
    table.add_section()
    held = len(plan.held)
    count = (
        f"{held} of {len(plan.entries)} params held by rank 0"
        if plan.stage_group is not None
        else f"{held} params"
    )
    table.add_row(count, *[""] * (len(columns) - 1), human(plan.bytes_per_rank()))
    table.caption = (
        f"unsharded model {human(plan.total_bytes())}; padding from uneven shards "
        f"{human(plan.padding_bytes())} over all ranks"
    )
    table.caption_justify = "left"
    return _text(table)


def render_comms(stats: CommStats) -> str:
    """One row per (kind, mesh axis): collectives per step and the bytes of their buffers;
    under a pipeline, a line on what one send or receive carries."""
    table = Table()
    for column in ("kind", "axis", "count", "bytes"):
        table.add_column(column, justify="right" if column in ("count", "bytes") else "left")
    for kind, axis in sorted(stats.count):
        table.add_row(kind, axis, str(stats.count[(kind, axis)]), human(stats.bytes[(kind, axis)]))
    table.add_section()
    table.add_row("total", "", str(stats.total_count()), human(stats.total_bytes()))
    lines = ["collectives per step on rank 0 (buffer bytes):", _text(table)]
    for kind, axis in sorted(k for k in stats.count if k[0] in ("send", "recv")):
        count, nbytes = stats.count[(kind, axis)], stats.bytes[(kind, axis)]
        each = f"{nbytes // count:,} B each" if nbytes % count == 0 else "sizes vary"
        lines.append(
            f"  {kind} on {axis}: {count} tensors, each a microbatch's activation (forward) or "
            f"its grad (backward), or state carried beside it; {each}; {nbytes:,} B in all"
        )
    return "\n".join(lines)


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
