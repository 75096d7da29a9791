"""``clip_by_global_norm`` and ``global_norm``, correct for trees of DTensors.

The norm of a tree is ``sqrt(sum_i ||x_i||**2)`` over every leaf. For a DTensor leaf,
``torch._foreach_norm`` returns a 0-d DTensor whose value is the norm of the *global*
tensor (a ``Shard`` placement leaves it pending as a norm-partial, resolved by one
all-reduce when read), so no leaf is ever reduced over its local shard alone and nothing
calls ``.to_local()``. Leaves are grouped by mesh (DTensors) or device (plain tensors);
each group's per-leaf norms are stacked and reduced to one 0-d value, so a group costs one
collective, not one per leaf; DTensor group norms become plain tensors with
``full_tensor()`` before the groups are summed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from d9d import tree
from d9d.core._context import current
from d9d.core._plan import Plan
from d9d.optim._checks import check_positive
from d9d.optim._offloaded import check_not_offloaded
from d9d.optim._transform import GradientTransformation, by_kind, check_state

__all__ = ["ClipByGlobalNormState", "clip_by_global_norm", "global_norm"]


class ClipByGlobalNormState(NamedTuple):
    """State of ``clip_by_global_norm``: empty."""


def global_norm(updates: Any) -> torch.Tensor:
    """The L2 norm of all leaves of ``updates`` together, as a 0-d float32 (or wider) tensor.

    Args:
        updates: a pytree of tensors and/or DTensors (DTensors may live on several meshes).

    Returns:
        A 0-d plain tensor on the first leaf's device, equal on every rank; 0 for an empty
        tree. It is float32, or float64 when a leaf is float64 (or complex128). A complex
        leaf counts ``|z|**2`` per element. Inside a ``pipeline`` step
        it is the norm over every stage's leaves (a tied param counted once).

    Example:
        >>> import torch
        >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])})
        tensor(5.)
    """
    check_not_offloaded(
        "global_norm (clip_by_global_norm)",
        "the norm would be this rank's alone",
        "take it before, on the device: chain(clip_by_global_norm(1.0), offloaded(adamw(...)))",
    )
    leaves = tree.leaves(updates)
    wide = (torch.float64, torch.complex128)
    dtype = torch.float64 if any(leaf.dtype in wide for leaf in leaves) else torch.float32
    square = _squared_norm(leaves, dtype)
    step = current()
    if step is not None and step.plan.stage_group is not None:
        square = _over_stages(square, updates, step.plan, dtype)
    return square.sqrt()


def _squared_norm(leaves: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    groups: dict[Any, list[torch.Tensor]] = {}
    for leaf in leaves:
        # A complex leaf's norm is that of its real and imaginary parts (as clip_grad_norm_'s
        # is); _foreach_norm with a real dtype refuses complex tensors.
        leaf = torch.view_as_real(leaf) if leaf.is_complex() else leaf
        key = leaf.device_mesh if isinstance(leaf, DTensor) else leaf.device
        groups.setdefault(key, []).append(leaf)
    if not groups:
        return torch.zeros((), dtype=dtype)
    squares = []
    for group in groups.values():
        norms = torch._foreach_norm(group, 2, dtype=dtype)
        total = torch.linalg.vector_norm(torch.stack(norms))
        if isinstance(total, DTensor):
            total = total.full_tensor()
        squares.append(total.square())
    device = next(iter(groups.values()))[0].device
    return torch.stack([s.to(device) for s in squares]).sum()


def _over_stages(
    square: torch.Tensor, updates: Any, plan: Plan, dtype: torch.dtype
) -> torch.Tensor:
    """The squared norm summed over the plan's stages (one all-reduce); a leaf held by
    two ranks (a tied param) counts once."""
    pairs = tree.flatten_with_paths(updates)[0]
    entries = plan.entries
    shared = [leaf for path, leaf in pairs if path in entries and entries[path].stage_copies > 1]
    if shared:
        square = square - _squared_norm(shared, dtype).to(square.device) / 2
    return torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_reduce(square, "sum", plan.stage_group)
    )


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates by ``max_norm / max(norm, max_norm)``, ``norm`` being their global norm.

    Updates whose global norm is at most ``max_norm`` pass unchanged; otherwise all are
    shrunk by the same factor so the global norm becomes ``max_norm``. This equals
    ``torch.nn.utils.clip_grad_norm_`` up to its ``1e-6`` in the denominator. The factor is
    a 0-d tensor (no ``.item()``, no branch on its value). See ``global_norm`` for DTensors.
    Non-finite updates raise nothing, as ``clip_grad_norm_`` by default: a NaN makes every
    update NaN; an infinity makes the factor 0 (finite updates 0, infinite ones NaN).

    Args:
        max_norm: the largest allowed global L2 norm (> 0).

    Returns:
        A ``GradientTransformation`` with state ``ClipByGlobalNormState()``.

    Raises:
        ValueError: ``max_norm`` is not a finite number > 0.

    Example:
        >>> import torch
        >>> clip = clip_by_global_norm(1.0)
        >>> u = {"w": torch.tensor([3.0, 4.0])}
        >>> clip.update(u, clip.init(u))[0]["w"]
        tensor([0.6000, 0.8000])
    """
    check_positive("max_norm", max_norm)

    def init(params: Any) -> ClipByGlobalNormState:
        del params
        return ClipByGlobalNormState()

    def update(updates: Any, state: ClipByGlobalNormState, params: Any = None) -> tuple[Any, Any]:
        check_state(state, ClipByGlobalNormState, "clip_by_global_norm")
        del params
        leaves, spec = tree.flatten(updates)
        norm = global_norm(updates)
        factor = max_norm / torch.clamp(norm, min=max_norm)
        (clipped,) = by_kind(lambda us: (torch._foreach_mul(us, factor),), leaves, outputs=1)
        return tree.unflatten(spec, clipped), state

    return GradientTransformation(init, update)
