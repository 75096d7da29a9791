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

__all__ = ["check_placed", "place_state", "without"]


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
    path laid out as the param's plan keeps its state; other tensors (step counts) moved to
    the mesh's device.

    Raises:
        PlanError: A param's plan keeps its state on another device than the mesh's (not
            built yet).
    """
    by_length = sorted(plan.entries, key=len, reverse=True)

    def place(path: str, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        for param in by_length:
            entry = plan.entries[param]
            if (path == param or path.endswith("." + param)) and tuple(leaf.shape) == entry.shape:
                if entry.state_device not in (None, mesh.device_type):
                    raise PlanError(
                        f"the plan keeps the optimizer state of {param!r} on "
                        f"{entry.state_device!r}, but the mesh is on {mesh.device_type!r}: "
                        "optimizer state on another device is not built yet; keep it on the "
                        "mesh's device (state_device=None)"
                    )
                return distribute(leaf, mesh, entry.state_kept)
        return leaf.to(mesh.device_type) if leaf.device.type != "meta" else leaf

    return tree.map_with_path(place, opt_state)


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
