"""``scale_by_lion``: the sign of an interpolated momentum (Chen et al. 2023, arXiv:2302.06675)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from d9d import tree
from d9d.optim._checks import check_unit_interval
from d9d.optim._transform import (
    STATE_FIX,
    GradientTransformation,
    by_kind,
    check_params,
    check_same_layout,
    check_state,
    foreach_lerp,
    zero_count,
)

__all__ = ["ScaleByLionState", "scale_by_lion"]


class ScaleByLionState(NamedTuple):
    """State of ``scale_by_lion``."""

    # 0-d int64 tensor: the number of updates done so far.
    count: torch.Tensor
    # Momentum (EMA of the updates with rate b2), laid out like the params, in each param's dtype.
    mu: Any


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Replace each update by ``sign(b1 * m + (1 - b1) * g)``, then move ``m`` toward ``g``.

    The momentum is updated after the sign is taken: ``m = b2 * m + (1 - b2) * g``. Every
    entry of the output is -1, 0 or +1, so the learning rate sets the step size directly
    (Lion's is usually 3-10x smaller than AdamW's).

    Args:
        b1: interpolation rate used for the update direction, in [0, 1) (default 0.9).
        b2: decay rate of the momentum, in [0, 1) (default 0.99).

    Returns:
        A ``GradientTransformation`` with state ``ScaleByLionState(count, mu)``.

    Raises:
        ValueError: ``b1`` or ``b2`` outside [0, 1).
        TypeError: at ``init``, a params leaf is not a floating tensor (complex ones too:
            Lion's sign has no agreed complex form).

    Example:
        >>> import torch
        >>> lion = scale_by_lion()
        >>> params = {"w": torch.zeros(3)}
        >>> lion.update({"w": torch.tensor([0.5, 0.0, -2.0])}, lion.init(params))[0]["w"]
        tensor([ 1.,  0., -1.])
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)

    def init(params: Any) -> ScaleByLionState:
        # Complex params are refused: Lion's sign has no agreed complex form (torch.sign
        # raises; optax takes z/|z|, the paper says nothing).
        check_params(params, "scale_by_lion", complex_ok=False)
        return ScaleByLionState(count=zero_count(params), mu=tree.map(torch.zeros_like, params))

    def update(updates: Any, state: ScaleByLionState, params: Any = None) -> tuple[Any, Any]:
        check_state(state, ScaleByLionState, "scale_by_lion")
        check_same_layout(updates, state.mu, what="mu state", fix=STATE_FIX)
        del params
        leaves, spec = tree.flatten(updates)

        def signs(grads: list, mu: list) -> tuple[Any, ...]:
            direction = foreach_lerp(mu, grads, 1.0 - b1)
            torch._foreach_sign_(direction)
            return direction, foreach_lerp(mu, grads, 1.0 - b2)

        new_updates, mu = by_kind(signs, leaves, tree.leaves(state.mu), outputs=2)
        new_state = ScaleByLionState(count=state.count + 1, mu=tree.unflatten(spec, mu))
        return tree.unflatten(spec, new_updates), new_state

    return GradientTransformation(init, update)
