"""When ``shard_params`` gathers a param: its annotation on the param's plan."""

from __future__ import annotations

from dataclasses import dataclass

from ...core._param_plan import ParamPlan

__all__ = ["Schedule", "schedule_of"]


@dataclass(frozen=True)
class Schedule:
    """``shard_params``' annotation of a param it gathers.

    Attributes:
        regather: Its gathered copy is dropped after the forward and gathered again for the
            backward (``reshard_after_forward=True``).
        prefetch: Its all-gather may be issued while the block before it computes (in the
            backward: the block after it), ``prefetch=True``.
    """

    regather: bool = False
    prefetch: bool = False


def schedule_of(entry: ParamPlan) -> Schedule:
    """``entry``'s schedule (neither regathered nor prefetched without one)."""
    return entry.annotation(Schedule) or Schedule()
