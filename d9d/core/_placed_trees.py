"""Laying params and optimizer state out on the mesh as a plan says, and checking them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .. import tree
from ..errors import ParamShapeError, PlanError
from ._gather import distribute
from ._plan import Plan
from ._state_device import placed_on

__all__ = [
    "check_placed",
    "check_placed_state",
    "kept_apart",
    "leaf_kinds",
    "place_state",
    "state_device",
    "without",
]


def without(state: Any, paths: set[str]) -> Any:
    """``state`` with the entries keyed by ``paths`` dropped from its dicts."""
    if isinstance(state, Mapping):
        return type(state)({k: without(v, paths) for k, v in state.items() if k not in paths})
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(without(v, paths) for v in state))
    if isinstance(state, list | tuple):
        return type(state)(without(v, paths) for v in state)
    return state


def place_state(opt_state: Any, plan: Plan, mesh: DeviceMesh) -> Any:
    """``opt_state`` with each leaf shaped like a param whose path ends with that param's
    path laid out as the param's plan keeps its state, on the plan's state device (a DTensor
    whose shard is on the host under ``state_device="cpu"``: ``_state_device``'s note);
    other tensors (step counts) moved to that device, or the mesh's.

    Raises:
        PlanError: The plan keeps optimizer state on more than one device.
    """
    by_length = sorted(plan.entries, key=len, reverse=True)
    device = state_device(plan)

    def place(path: str, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        entry = _entry_of(path, leaf, plan, by_length)
        if leaf.device.type == "meta":
            return leaf if entry is None else distribute(leaf, mesh, entry.state_kept)
        if entry is None:
            return leaf.to(device or mesh.device_type)
        if device is None:
            return distribute(leaf, mesh, entry.state_kept)
        return placed_on(leaf, mesh, entry.state_kept, device)

    return tree.map_with_path(place, opt_state)


def state_device(plan: Plan) -> torch.device | None:
    """The device the plan keeps optimizer state on, None for the mesh's.

    Raises:
        PlanError: Its params keep their state on different devices.
    """
    devices = {e.state_device for e in plan.entries.values()}
    if len(devices) > 1:
        raise PlanError(
            f"the plan keeps optimizer state on several devices ({sorted(map(str, devices))}); "
            "one optimizer's state (and its step count) lives on one: keep every param's "
            "state on the same device"
        )
    (kept,) = devices or {None}
    return None if kept is None else torch.device(kept)


def kept_apart(opt_state: Any, plan: Plan) -> list[bool]:
    """Per leaf of ``opt_state`` (``tree.leaves`` order): whether ``place_state`` keeps it on
    the plan's state device rather than the mesh's."""
    if state_device(plan) is None:
        return [False] * len(tree.leaves(opt_state))
    return [isinstance(leaf, torch.Tensor) for leaf in tree.leaves(opt_state)]


def _entry_of(path: str, leaf: torch.Tensor, plan: Plan, by_length: list[str]) -> Any:
    """The plan entry of the param whose state ``leaf`` (at ``path``) is, or None."""
    for param in by_length:
        entry = plan.entries[param]
        if (path == param or path.endswith("." + param)) and tuple(leaf.shape) == entry.shape:
            return entry
    return None


def check_placed(params: Any, plan: Plan) -> None:
    """Raise unless ``params`` has the plan's paths, each a DTensor stored as planned."""
    if not isinstance(params, Mapping) or params.keys() != set(plan.held):
        given = set(params) if isinstance(params, Mapping) else set()
        missing = sorted(set(plan.held) - given)[:5]
        extra = sorted(given - set(plan.held))[:5]
        raise PlanError(
            f"params do not match the placed plan (missing {missing}, unexpected {extra}); "
            "pass the params returned by step.place(...) or by the previous step"
        )
    for path, leaf in params.items():
        entry = plan.entries[path]
        if not isinstance(leaf, DTensor) or tuple(leaf.placements) != entry.storage:
            got = tuple(leaf.placements) if isinstance(leaf, DTensor) else "a plain tensor"
            raise PlanError(
                f"param {path!r} is {got} but the plan stores it as {entry.storage}; pass the "
                "params returned by step.place(...) or by the previous step"
            )
        if leaf.shape != entry.shape:
            raise ParamShapeError(
                f"param {path!r} has shape {tuple(leaf.shape)} but the plan's is {entry.shape}; "
                "pass the params returned by step.place(...) or by the previous step"
            )


def leaf_kinds(state: Any) -> tuple[str, ...]:
    """What each leaf of ``state`` is (``tree.leaves`` order): a DTensor, a plain tensor, or
    a Python value."""
    return tuple(_kind(leaf) for leaf in tree.leaves(state))


def _kind(leaf: Any) -> str:
    """A tensor leaf's layout; any other leaf (a Python number whose type may change between
    steps, a loss scale halving to a float) is a value alike."""
    if isinstance(leaf, DTensor):
        return "a DTensor"
    return "a plain tensor" if isinstance(leaf, torch.Tensor) else "a Python value"


def check_placed_state(opt_state: Any, placed: tuple[str, ...]) -> None:
    """Raise unless ``opt_state``'s leaves are of the kinds ``placed`` (``leaf_kinds`` of the
    state ``place`` returned): a state never placed, or another optimizer's, is named here
    rather than failing inside the update on a DTensor beside a plain tensor."""
    kinds = leaf_kinds(opt_state)
    if kinds == placed:
        return
    fix = "pass the opt_state returned by step.place(...) or by the previous step"
    if len(kinds) != len(placed):
        raise PlanError(
            f"opt_state has {len(kinds)} leaves but the one step.place returned has "
            f"{len(placed)} (another optimizer's state?); {fix}"
        )
    paths = [path for path, _ in tree.flatten_with_paths(opt_state)[0]]
    index = next(i for i, (a, b) in enumerate(zip(kinds, placed, strict=True)) if a != b)
    raise PlanError(
        f"opt_state leaf {paths[index]!r} is {kinds[index]} but step.place laid it out as "
        f"{placed[index]}; {fix}"
    )
