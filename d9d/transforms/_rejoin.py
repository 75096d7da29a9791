"""Rejoin: a restarted replica group takes a live peer's params and optimizer state
(``fault_tolerant``'s, and ``diloco``'s with its anchor and outer state among them).

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

from .. import tree
from ..core._gather import local_like
from ..errors import PlanError

__all__ = ["PeerState", "adopt", "served"]


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


class PeerState:
    """A replica group's part of torchft's state dict, under ``key``: what this rank serves a
    peer that heals from it (:meth:`serve`), and what it received when it healed itself
    (:meth:`take`). ``name`` starts the refusal's message, ``serve_call`` names the call
    that serves a restored checkpoint."""

    def __init__(self, manager: Any, key: str, name: str, serve_call: str) -> None:
        self.name, self.serve_call = name, serve_call
        self.live: tuple[Any, Any, dict[str, Any]] | None = None  # served to a healing peer
        self.received: dict[str, Any] | None = None  # a peer's, until taken
        manager.register_state_dict_fn(key, self._receive, self._serve)

    def serve(self, params: Any, opt_state: Any, **flags: Any) -> None:
        """Serve ``params`` and ``opt_state`` (and JSON ``flags``) to a peer that heals from
        this group at its next quorum."""
        self.live = (params, opt_state, flags)

    def _serve(self) -> dict[str, Any]:
        """Called by torchft (its quorum thread) when a peer group heals from this one."""
        if self.received is not None:
            # Healed from a peer but no step ran since (a group resumed behind another, both
            # still waiting for the rest): the peer's state is what the next step starts from.
            return self.received
        if self.live is None:
            raise PlanError(
                f"{self.name}: a peer asked for live state before any step ran; a loop that "
                f"restores a checkpoint serves it first with {self.serve_call}"
            )
        params, opt_state, flags = self.live
        return {**served(params, opt_state), **flags}

    def _receive(self, state: dict[str, Any]) -> None:
        """Called by torchft when this group heals, in ``start_quorum``."""
        self.received = state

    def take(self, params: Any, opt_state: Any) -> tuple[Any, Any, dict[str, Any]] | None:
        """The received state laid out as ``params`` and ``opt_state`` (:func:`adopt`), and
        the flags it was served with; None when this group did not heal."""
        if self.received is None:
            return None
        state, self.received = self.received, None
        params, opt_state = adopt(state, params, opt_state)
        flags = {k: v for k, v in state.items() if k not in ("layout", "pieces")}
        return params, opt_state, flags
