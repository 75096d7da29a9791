"""``shard_params(opt_state_device="cpu")``: the optimizer must update where its state is.

``place`` keeps the state's shards in host memory (``d9d/core/_state_device.py``); the step
body's ``opt.update`` then meets grads on the mesh's device and state on the host, which a
foreach op refuses on an accelerator (and a CPU mesh would hide). The optimizer's
elementwise part must be wrapped in :func:`d9d.optim.offloaded`, which copies the grads to
the host and the updates back; this check finds its state in the step's optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...errors import PlanError
from ...optim import OffloadedState

__all__ = ["check_offloaded"]


def check_offloaded(opt_state: Any, device: str | None) -> None:
    """Raise unless ``opt_state`` holds an :class:`~d9d.optim.OffloadedState`.

    Raises:
        PlanError: it holds none, and holds tensors (an optimizer without state needs none).
    """
    if _holds_offloaded(opt_state) or not _holds_tensors(opt_state):
        return
    raise PlanError(
        f"shard_params(opt_state_device={device!r}) keeps the optimizer state on the host, "
        "but the optimizer does not update there: wrap its elementwise part in "
        "d9d.optim.offloaded, e.g. chain(clip_by_global_norm(1.0), offloaded(adamw(...))), "
        "and build the state with that optimizer's init"
    )


def _holds_offloaded(state: Any) -> bool:
    return _holds(state, lambda leaf: isinstance(leaf, OffloadedState))


def _holds_tensors(state: Any) -> bool:
    return _holds(state, lambda leaf: isinstance(leaf, torch.Tensor))


def _holds(state: Any, found: Callable[[Any], bool]) -> bool:
    """Whether ``found`` holds for ``state`` or anything in its mappings, tuples and lists."""
    if found(state):
        return True
    if isinstance(state, Mapping):
        return any(_holds(v, found) for v in state.values())
    if isinstance(state, tuple | list):
        return any(_holds(v, found) for v in state)
    return False
