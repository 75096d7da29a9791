"""``trace``: heavy-ball momentum with the semantics of ``torch.optim.SGD`` (dampening 0)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from d9d import tree
from d9d.optim._checks import check_bool, check_non_negative
from d9d.optim._transform import (
    STATE_FIX,
    GradientTransformation,
    by_kind,
    check_params,
    check_same_layout,
    check_state,
)

__all__ = ["TraceState", "trace"]


class TraceState(NamedTuple):
    """State of ``trace``."""

    # The momentum buffer, laid out like the params, in each param's dtype; zeros at init.
    trace: Any


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Accumulate a momentum ``b = decay * b + g`` and output ``b`` (or ``g + decay * b``).

    This is ``torch.optim.SGD``'s momentum with ``dampening=0``. Torch starts the buffer at
    the first gradient (``b_1 = g_1``); starting it at zeros gives the same ``b_1 =
    decay * 0 + g_1``, so the two agree from the first step on. Dampening is not offered:
    torch skips it on the first step, which makes it a different method, not a scale.

    Args:
        decay: the momentum coefficient, >= 0.
        nesterov: output the Nesterov look-ahead ``g + decay * b`` instead of ``b``
            (default False).

    Returns:
        A ``GradientTransformation`` with state ``TraceState(trace)``.

    Raises:
        ValueError: ``decay`` is negative, ``nesterov`` is not a bool, or ``nesterov=True``
            with ``decay == 0``.
        TypeError: at ``init``, a params leaf is not a floating or complex tensor.

    Example:
        >>> import torch
        >>> momentum = trace(0.5)
        >>> params = {"w": torch.zeros(1)}
        >>> state = momentum.init(params)
        >>> _, state = momentum.update({"w": torch.ones(1)}, state)
        >>> momentum.update({"w": torch.ones(1)}, state)[0]["w"]
        tensor([1.5000])
    """
    check_non_negative("decay", decay)
    check_bool("nesterov", nesterov)
    if nesterov and decay == 0:
        raise ValueError(
            f"nesterov=True needs a momentum, got {decay=}; pass decay > 0 or nesterov=False"
        )

    def init(params: Any) -> TraceState:
        check_params(params, "trace")
        return TraceState(trace=tree.map(torch.zeros_like, params))

    def update(updates: Any, state: TraceState, params: Any = None) -> tuple[Any, Any]:
        check_state(state, TraceState, "trace")
        check_same_layout(updates, state.trace, what="trace state", fix=STATE_FIX)
        del params
        leaves, spec = tree.flatten(updates)

        def accumulate(grads: list, buffers: list) -> tuple[Any, ...]:
            buffers = torch._foreach_mul(buffers, decay)
            torch._foreach_add_(buffers, grads)
            if nesterov:
                return torch._foreach_add(grads, buffers, alpha=decay), buffers
            return buffers, buffers

        new_updates, buffers = by_kind(accumulate, leaves, tree.leaves(state.trace), outputs=2)
        return tree.unflatten(spec, new_updates), TraceState(trace=tree.unflatten(spec, buffers))

    return GradientTransformation(init, update)
