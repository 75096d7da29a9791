"""``DiLoCoState``: what ``diloco`` carries between calls, beside the inner optimizer's state."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["DiLoCoState"]


class DiLoCoState(NamedTuple):
    """The optimizer state of a ``diloco`` step; ``step.place`` builds it.

    Every tree is laid out like the params (the same paths, DTensors with the params'
    placements), so ``d9d.checkpoint`` saves and restores it like any optimizer state.
    """

    # The inner optimizer's state, as the wrapped step takes it.
    inner: Any
    # The params at the last outer round (the start of the run before the first): equal on
    # every replica group, the origin of the next pseudo-gradient.
    anchor: Any
    # The outer optimizer's state (Nesterov's momentum by default), laid out like the params.
    outer: Any
    # A 0-d int64 CPU tensor: inner steps taken since the start of the run.
    inner_step: Any
    # A 0-d int64 tensor: the valid tokens this group's inner steps trained on since the
    # anchor (their losses' counts over the group's data ranks), its weight in the next round;
    # 0 after each round. On the device the loss counted them on.
    tokens: Any
