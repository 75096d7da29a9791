"""What ``d9d train`` prints while it runs: a live progress bar on a terminal, and one plain,
flushed line per logged step otherwise (``d9d train > log.txt``), where a live bar would show
nothing until the run ends. Only rank 0 prints."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

__all__ = ["TrainProgress", "progress_line"]


def progress_line(record: dict[str, float], total: int) -> str:
    """One logged step as a line: ``step 4/200 loss 3.2101 lr 3.00e-03 ...``."""
    parts = [
        f"step {int(record['step'])}/{total}",
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.2e}",
        f"grad_norm {record['grad_norm']:.3f}",
        f"tokens/s {record['tokens_per_s']:,.0f}",
        f"step_time {record['step_time_s'] * 1e3:.1f} ms",
    ]
    for name in ("peak_memory_gib", "peak_rss_gib"):
        if name in record:
            parts.append(f"{name.removesuffix('_gib')} {record[name]:.2f} GiB")
    for name in ("mfu", "mfu_bf16"):
        if name in record:
            parts.append(f"{name} {record[name]:.1%}")
    for name in ("aux_loss", "load_balance", "eval_loss"):
        if name in record:
            parts.append(f"{name} {record[name]:.4f}")
    if "eval_perplexity" in record:
        parts.append(f"eval_perplexity {record['eval_perplexity']:.2f}")
    return " ".join(parts)


class TrainProgress:
    """The progress of one run of ``total`` steps that starts after step ``completed``.

    Args:
        console: Where it goes; a bar when ``console.is_terminal``, lines otherwise.
        total: The run's last step.
        completed: Steps done before this call.
        show: Whether this rank prints at all.
    """

    def __init__(self, console: Console, total: int, completed: int, *, show: bool) -> None:
        self._console = console
        self._total = total
        self._lines = show and not console.is_terminal
        self._bar = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("loss {task.fields[loss]:.4f}{task.fields[moe]}"),
            TextColumn("{task.fields[tok_s]:,.0f} tok/s"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            disable=not show or self._lines,
        )
        self._task = self._bar.add_task(
            "train", total=total, completed=completed, loss=float("nan"), tok_s=0.0, moe=""
        )

    def advance(self, loss: float | None = None, record: dict[str, float] | None = None) -> None:
        """One more step done; ``loss`` when it was read, ``record`` when it was logged."""
        fields: dict[str, object] = {} if loss is None else {"loss": loss}
        if record is not None:
            fields["tok_s"] = record["tokens_per_s"]
            if "aux_loss" in record:  # MoE: aux loss, max / mean expert load
                fields["moe"] = f" aux {record['aux_loss']:.4f} load {record['load_balance']:.2f}"
            if self._lines:
                print(progress_line(record, self._total), file=self._console.file, flush=True)
        self._bar.update(self._task, advance=1, **fields)

    def __enter__(self) -> TrainProgress:
        self._bar.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._bar.stop()
