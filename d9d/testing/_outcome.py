"""What each rank of a ``run_on_ranks`` call did, and the error that reports a failed run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from d9d.errors import RankFailedError

__all__ = ["RankOutcome", "results_or_raise", "summarize"]

# How long the other ranks may still run once one rank failed: long enough for ranks that
# fail the same way to report it too, short enough that a rank blocked in a collective the
# failed rank will never enter does not hold the run until `timeout`.
FAILURE_GRACE_S = 2.0

# How long a rank that was told to stop (SIGTERM, or SystemExit in a thread) may take to go.
STOP_GRACE_S = 1.0

Status = Literal["ok", "raised", "crashed", "stopped", "timed_out"]


@dataclass(frozen=True)
class RankOutcome:
    """One rank's end: its return value, or why it has none."""

    rank: int
    # ok: returned `value`. raised: `fn` (or the set-up around it) raised; `detail` is the
    # formatted traceback. crashed: the process died without reporting. stopped: the runner
    # stopped it after another rank failed. timed_out: still running at the deadline.
    status: Status
    value: Any = None
    detail: str = ""
    summary: str = ""  # "ValueError: first line of its message", for a rank that raised
    failed_at: float = 0.0  # time.time() of the failure, to tell which rank failed first


def summarize(exc: BaseException) -> str:
    """``"TypeName: first line of the message"``."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def results_or_raise(
    outcomes: list[RankOutcome], *, method: str, world_size: int, timeout: float
) -> list[Any]:
    """The ranks' return values in rank order, or a RankFailedError describing the failure."""
    by_status: dict[str, list[RankOutcome]] = {}
    for outcome in outcomes:
        by_status.setdefault(outcome.status, []).append(outcome)
    if len(by_status.get("ok", ())) == world_size:
        return [outcome.value for outcome in outcomes]

    call = f"run_on_ranks(method={method!r}, world_size={world_size}, timeout={timeout})"
    failed = by_status.get("raised", []) + by_status.get("crashed", [])
    failed.sort(key=lambda o: o.failed_at)
    timed_out = [o.rank for o in by_status.get("timed_out", [])]
    finished = [o.rank for o in by_status.get("ok", [])]
    stopped = [o.rank for o in by_status.get("stopped", [])]
    if failed:
        ranks = sorted(o.rank for o in failed)
        head = [f"{call} failed on rank(s) {ranks}; rank {failed[0].rank} failed first:"]
        head += [f"  rank {o.rank}: {o.summary or o.detail}" for o in failed]
    else:
        head = [
            f"{call} timed out: rank(s) {timed_out} did not finish within {timeout} s. A rank "
            "that never returns is usually blocked in a collective that another rank did not "
            "enter, or in an endless loop; pass a larger timeout= if the work is only slow."
        ]
    if stopped:
        head.append(f"Rank(s) {stopped} were stopped because another rank failed.")
    if failed and timed_out:
        head.append(f"Rank(s) {timed_out} were still running and were stopped.")
    if finished:
        head.append(f"Rank(s) {finished} finished.")
    stuck = [o for o in outcomes if o.status == "timed_out"]
    sections = [f"--- rank {o.rank} ---\n{o.detail.rstrip()}" for o in failed + stuck if o.detail]
    raise RankFailedError("\n".join(head + sections)) from None
