"""Rejoin: a restarted replica group takes a live peer's params and optimizer state.

torchft heals a replica group whose step is behind the quorum's: at that quorum, rank ``r``
of a live peer group serves its state dict through the manager's checkpoint transport
(HTTP by default) to rank ``r`` of the healing group, which loads it before its step runs.
What travels here is each rank's local pieces (the shard its layout keeps; the whole tensor
where it is replicated) and a line per leaf describing the layout; the healing rank checks
that the peer's layout is its own, where the pieces line up, and lays them out as its own
params and optimizer state. No collective runs, and the copy is bitwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ... import tree
from ...core._gather import local_like
from ...errors import PlanError

__all__ = ["STATE_KEY", "adopt", "served"]

STATE_KEY = "d9d.fault_tolerant"
"""The key of the params and optimizer state in torchft's state dict of a replica group."""


def _leaf_layout(path: str, leaf: Any) -> str:
    """One line saying how this rank holds ``leaf``: equal lines on two ranks mean equal
    local pieces (shapes, dtypes, placements, mesh and the rank's coordinate on it)."""
    if isinstance(leaf, DTensor):
        mesh = leaf.device_mesh
        axes = ", ".join(
            f"{name}={size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape, strict=True)
        )
        placements = ", ".join(str(p) for p in leaf.placements)
        return (
            f"{path}: {leaf.dtype} {tuple(leaf.shape)} as ({placements}) on mesh ({axes}) "
            f"at coordinate {tuple(mesh.get_coordinate() or ())}"
        )
    if isinstance(leaf, torch.Tensor):
        return f"{path}: {leaf.dtype} {tuple(leaf.shape)}"
    return f"{path}: {type(leaf).__name__}"


def _leaves(params: Any, opt_state: Any) -> tuple[list[tuple[str, Any]], tuple[Any, Any]]:
    """``(path, leaf)`` of the params, then of the optimizer state, and both structures."""
    ps, param_spec = tree.flatten_with_paths(params)
    ss, state_spec = tree.flatten_with_paths(opt_state)
    leaves = [(f"params.{p}", x) for p, x in ps] + [(f"opt_state.{p}", x) for p, x in ss]
    return leaves, (param_spec, state_spec)


def served(params: Any, opt_state: Any) -> dict[str, list[Any]]:
    """What this rank serves a rejoining peer: its layout and its local pieces.

    The pieces are the live tensors themselves, not copies: a step builds new params and
    state and never writes into those it was called with, and torchft stops serving them
    at the step's commit vote.
    """
    leaves, _ = _leaves(params, opt_state)
    return {
        "layout": [_leaf_layout(path, leaf) for path, leaf in leaves],
        "pieces": [_local(leaf) for _, leaf in leaves],
    }


def _local(leaf: Any) -> Any:
    if isinstance(leaf, DTensor):
        return leaf.to_local()
    return leaf if isinstance(leaf, torch.Tensor) else None


def adopt(state: dict[str, list[Any]], params: Any, opt_state: Any) -> tuple[Any, Any]:
    """``params`` and ``opt_state`` with a peer's pieces (from :func:`served`) in place of
    their own, laid out as they are.

    Raises:
        PlanError: The peer holds another layout (mesh, placements, shapes, dtypes, the
            params or optimizer state's paths); the message names the first leaf that
            differs, as the peer holds it and as this rank does.
    """
    leaves, structure = _leaves(params, opt_state)
    ours = [_leaf_layout(path, leaf) for path, leaf in leaves]
    theirs = list(state["layout"])
    if ours != theirs:
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        if at is None:
            at = min(len(ours), len(theirs))
            differs = f"the peer holds {len(theirs)} leaves, this rank {len(ours)}"
        else:
            differs = f"the peer holds {theirs[at]!r}, this rank {ours[at]!r}"
        raise PlanError(
            "this replica group cannot rejoin: its live peer's params and optimizer state are "
            f"laid out otherwise ({differs}); a group rejoins peers of its own layout only: "
            "restart it with the mesh, transforms, model and optimizer of the live groups"
        )
    out = []
    for (_, leaf), piece in zip(leaves, state["pieces"], strict=True):
        if isinstance(leaf, DTensor):
            out.append(local_like(piece.to(leaf.device), leaf))
        elif isinstance(leaf, torch.Tensor):
            out.append(piece.to(leaf.device))
        else:
            out.append(leaf)
    param_spec, state_spec = structure
    n = param_spec.num_leaves
    return tree.unflatten(param_spec, out[:n]), tree.unflatten(state_spec, out[n:])
