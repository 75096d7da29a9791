"""``offloaded``: an optimizer's update run where its state is kept (the host, under
``shard_params(opt_state_device="cpu")``).

[Note: the host update] The placed state's leaves are DTensors whose shards live in host
memory (``d9d/core/_state_device.py``). Each step copies this rank's grad shards (and param
shards, for weight decay) to the host, into pinned memory and asynchronously where they come
from an accelerator, waits for those copies once, runs the wrapped optimizer there on the
plain shards with its own foreach ops, and copies the updates back to the grads' device. The
wrapped optimizer sees shards, not DTensors: it must be elementwise (AdamW, Lion, SGD,
weight decay, schedules); a global norm over shards would be each rank's own, so
``clip_by_global_norm`` is refused inside it and belongs before it, on the device. Where the
state is on the grads' device (the mesh is on the CPU) the copies return their inputs: the
same code runs, with nothing to copy.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from d9d import tree
from d9d.core._gather import local_like
from d9d.core._state_device import kept_on, to_device
from d9d.errors import PlanError
from d9d.optim._transform import GradientTransformation, check_same_layout, check_state

__all__ = ["OffloadedState", "check_not_offloaded", "offloaded", "shown_to_masks"]

_running = threading.local()


class OffloadedState(NamedTuple):
    """State of ``offloaded``."""

    # The wrapped transformation's state, its leaves where ``step.place`` put them (their
    # shards on the host under ``shard_params(opt_state_device="cpu")``).
    inner_state: Any


def offloaded(inner: GradientTransformation) -> GradientTransformation:
    """Run ``inner``'s update on the device its state is kept on, shard by shard.

    ``shard_params(mesh, "fsdp", opt_state_device="cpu")`` keeps the optimizer state in
    host memory; this wrapper runs the update there: each step it copies this
    rank's grad and param shards to the state's device, runs ``inner`` on them (its
    vectorized foreach ops, on the host's cores), and copies the updates back to where the
    grads are. Where state and grads share a device, nothing is copied and the update equals
    ``inner``'s bitwise. ``inner`` sees local shards, not DTensors, so it must be elementwise:
    put ``clip_by_global_norm`` before it, ``chain(clip_by_global_norm(1.0),
    offloaded(adamw(...)))``, where the norm is taken over every rank's grads on the device.
    A ``masked`` callable inside it is shown the whole param's shape (a meta tensor), not
    the shard's, so it selects as it does on the device.

    Args:
        inner: an elementwise transformation (``adamw(...)``, ``lion(...)``,
            ``master_weights(adamw(...))``).

    Returns:
        A ``GradientTransformation`` with state ``OffloadedState(inner_state)``.

    Raises:
        TypeError: ``inner`` is not a ``GradientTransformation``.
        PlanError: at ``update``, ``inner`` takes a global norm (``clip_by_global_norm``,
            ``global_norm``) or rounds stochastically (``stochastic_round``: wrap this
            instead, ``stochastic_round(offloaded(adamw(...)))``).

    Example:
        >>> import torch, d9d.optim as optim
        >>> opt = optim.offloaded(optim.sgd(0.5))
        >>> params = {"w": torch.ones(2)}
        >>> updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.5000, -0.5000])
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"offloaded() wraps a GradientTransformation, got {inner!r}; pass one built by "
            "d9d.optim, e.g. offloaded(d9d.optim.adamw(1e-3))"
        )

    def init(params: Any) -> OffloadedState:
        return OffloadedState(inner.init(params))

    def update(
        updates: Any, state: OffloadedState, params: Any = None
    ) -> tuple[Any, OffloadedState]:
        check_state(state, OffloadedState, "offloaded")
        if params is not None:
            check_same_layout(params, updates, what="grads")
        stored, state_spec = tree.flatten(state.inner_state)
        grads, spec = tree.flatten(updates)
        device = _kept_on(stored, grads)
        copies = [to_device(_local(g), device, pin=True) for g in grads]
        host_params = None
        if params is not None:
            leaves = tree.leaves(params)
            host_params = tree.unflatten(
                spec, [to_device(_local(p), device, pin=True) for p in leaves]
            )
            grads_and_params = [*grads, *leaves]
        else:
            grads_and_params = grads
        _wait_for_copies(grads_and_params, device)
        inner_state = tree.unflatten(state_spec, [_local(leaf) for leaf in stored])
        _running.active = True
        _running.shapes = {path: g.shape for path, g in tree.flatten_with_paths(updates)[0]}
        try:
            steps, inner_state = inner.update(
                tree.unflatten(spec, copies), inner_state, host_params
            )
        finally:
            _running.active = False
            _running.shapes = None
        new, new_spec = tree.flatten(inner_state)
        kept = [_like(n, old) for n, old in zip(new, stored, strict=True)]
        back = [_back(u, g) for u, g in zip(tree.leaves(steps), grads, strict=True)]
        return tree.unflatten(spec, back), OffloadedState(tree.unflatten(new_spec, kept))

    return GradientTransformation(init, update)


def check_not_offloaded(what: str, why: str, instead: str) -> None:
    """Raise unless ``offloaded``'s inner update is not running: ``what`` needs more than
    this rank's shards, which is all it would see there (``why``); ``instead`` says where
    it belongs.

    Raises:
        PlanError: it is running.
    """
    # Not while Dynamo traces (a jitted step is refused offloaded state), so it reads no
    # thread-local there.
    if not torch.compiler.is_compiling() and getattr(_running, "active", False):
        raise PlanError(
            f"{what} runs inside d9d.optim.offloaded(...), which updates this rank's shards "
            f"on the host: {why}; {instead}"
        )


def shown_to_masks(path: str, leaf: torch.Tensor) -> torch.Tensor:
    """What a ``masked`` callable is shown for the leaf at ``path``: ``leaf`` itself, but inside
    ``offloaded``'s inner update, where ``leaf`` is this rank's shard, a meta tensor of the
    whole param's shape and the shard's dtype, so a mask decided from shapes selects the
    params it selects on the device (a shard of 32 rows of a 64-row param is not a 32-row
    param)."""
    shapes = None if torch.compiler.is_compiling() else getattr(_running, "shapes", None)
    shape = None if shapes is None else shapes.get(path)
    if shape is None or shape == leaf.shape:
        return leaf
    return torch.empty(shape, dtype=leaf.dtype, device="meta")


def _kept_on(stored: list[Any], grads: list[Any]) -> torch.device:
    """The device of the state's tensors (the grads' without any)."""
    for leaf in (*stored, *grads):
        if isinstance(leaf, torch.Tensor):
            return _local(leaf).device
    return torch.device("cpu")


def _local(leaf: Any) -> Any:
    return leaf.to_local() if isinstance(leaf, DTensor) else leaf


def _wait_for_copies(sources: list[Any], device: torch.device) -> None:
    """Wait for the asynchronous copies of ``sources`` to ``device`` (none when every one is
    already there: the host reads them next)."""
    crossed = {
        _local(s).device
        for s in sources
        if isinstance(s, torch.Tensor) and _local(s).device != device
    }
    for source in crossed:
        torch.accelerator.synchronize(source)


def _like(new: Any, old: Any) -> Any:
    """A new state leaf laid out as the old one was (a DTensor kept on its device)."""
    if not isinstance(old, DTensor):
        return new
    return kept_on(new, old.device_mesh, tuple(old.placements), old.shape, old.stride())


def _back(update: torch.Tensor, grad: Any) -> Any:
    """``update`` on ``grad``'s device, laid out as ``grad``."""
    local = to_device(update, _local(grad).device, pin=False)
    return local_like(local, grad) if isinstance(grad, DTensor) else local
