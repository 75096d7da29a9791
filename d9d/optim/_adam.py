"""``scale_by_adam``: Adam's bias-corrected moment ratio, as foreach ops over the leaves."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from d9d import tree
from d9d.optim._checks import check_bool, check_non_negative, check_state_dtype, check_unit_interval
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

__all__ = ["ScaleByAdamState", "scale_by_adam"]


class ScaleByAdamState(NamedTuple):
    """State of ``scale_by_adam``."""

    # 0-d int64 tensor: the number of updates done so far.
    count: torch.Tensor
    # First moment (EMA of the updates), laid out like the params; each leaf in ``mu_dtype``
    # (default: its param's dtype).
    mu: Any
    # Second moment (EMA of the squared updates), laid out like the params, in ``nu_dtype``.
    nu: Any


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    nesterov: bool = False,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moments: ``m_hat / (sqrt(v_hat + eps_root) + eps)``.

    At step ``t`` (1-based): ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g**2``,
    ``m_hat = m / (1 - b1**t)``, ``v_hat = v / (1 - b2**t)``. With ``nesterov=True`` (NAdam
    without momentum decay) ``m_hat = b1 m / (1 - b1**(t+1)) + (1 - b1) g / (1 - b1**t)``.
    The bias corrections are computed in float64 from the 0-d ``count`` tensor, so nothing
    reads the step in Python. Chain with ``scale_by_learning_rate`` to get an optimizer.

    By default the moments take each param's dtype and the math runs in the grads' dtype.
    With ``mu_dtype`` or ``nu_dtype`` (e.g. ``torch.bfloat16``: 4 bytes of state per
    element instead of 8) the moments are stored in those dtypes, but read into float32 (or
    the grads' dtype, if wider), updated and divided there, and only the new moments are
    rounded back to their storage dtypes; the updates come out in that float32 dtype.

    A complex param is treated as the pair of its real and imaginary parts, as
    ``torch.optim.Adam`` does (``v`` averages ``re**2`` and ``im**2``, not ``g**2``); its
    moments are complex tensors of its dtype.

    Args:
        b1: decay rate of the first moment, in [0, 1) (default 0.9).
        b2: decay rate of the second moment, in [0, 1) (default 0.999).
        eps: added to the denominator outside the square root (default 1e-8).
        eps_root: added to ``v_hat`` inside the square root (default 0.0).
        nesterov: use the Nesterov form of the first moment (default False).
        mu_dtype: the first moment's storage dtype, a floating dtype of 2 bytes or more
            (default None: each param's dtype).
        nu_dtype: the second moment's storage dtype, likewise (default None).

    Returns:
        A ``GradientTransformation`` with state ``ScaleByAdamState(count, mu, nu)``; ``mu``
        and ``nu`` are laid out like the params, in ``mu_dtype``/``nu_dtype`` or each
        param's dtype.

    Raises:
        ValueError: ``b1`` or ``b2`` outside [0, 1), ``eps``/``eps_root`` negative,
            ``nesterov`` not a bool, or a
            state dtype that is not a floating dtype of 2 bytes or more (8-bit moments need
            per-block scales, which are not built); at ``init``, ``mu_dtype``/``nu_dtype``
            with complex params.
        TypeError: at ``init``, a params leaf is not a floating or complex tensor.

    Example:
        >>> import torch
        >>> adam = scale_by_adam()
        >>> params = {"w": torch.zeros(2)}
        >>> adam.update({"w": torch.tensor([2.0, -3.0])}, adam.init(params))[0]["w"]
        tensor([ 1.0000, -1.0000])
        >>> state = scale_by_adam(mu_dtype=torch.bfloat16).init(params)
        >>> state.mu["w"].dtype, state.nu["w"].dtype
        (torch.bfloat16, torch.float32)
    """
    check_unit_interval("b1", b1)
    check_unit_interval("b2", b2)
    check_non_negative("eps", eps)
    check_non_negative("eps_root", eps_root)
    check_bool("nesterov", nesterov)
    check_state_dtype("mu_dtype", mu_dtype)
    check_state_dtype("nu_dtype", nu_dtype)
    upcast = mu_dtype is not None or nu_dtype is not None

    def init(params: Any) -> ScaleByAdamState:
        check_params(params, "scale_by_adam")
        if upcast:
            complex_paths = [p for p, x in tree.flatten_with_paths(params)[0] if x.is_complex()]
            if complex_paths:
                raise ValueError(
                    f"scale_by_adam got mu_dtype={mu_dtype} / nu_dtype={nu_dtype} and complex "
                    f"params {complex_paths}: a real storage dtype would drop their imaginary "
                    "parts; leave mu_dtype and nu_dtype None, or mask the complex params out"
                )
        return ScaleByAdamState(
            count=zero_count(params),
            mu=tree.map(lambda p: torch.zeros_like(p, dtype=mu_dtype), params),
            nu=tree.map(lambda p: torch.zeros_like(p, dtype=nu_dtype), params),
        )

    def update(updates: Any, state: ScaleByAdamState, params: Any = None) -> tuple[Any, Any]:
        check_state(state, ScaleByAdamState, "scale_by_adam")
        # mu and nu are built alike by init: one check per step lines both up.
        check_same_layout(updates, state.mu, what="mu state", fix=STATE_FIX)
        del params
        count = state.count + 1
        t = count.to(torch.float64)
        bias_correction1 = 1.0 - torch.pow(b1, t)
        bias_correction2 = 1.0 - torch.pow(b2, t)
        leaves = tree.leaves(updates)

        def moments(grads: list, stored_mu: list, stored_nu: list) -> tuple[Any, ...]:
            complex_leaves = [g.is_complex() for g in grads]
            if any(complex_leaves):
                # As torch.optim.Adam: a complex leaf is a pair of real ones (real and
                # imaginary parts), so nu averages re**2 and im**2, never the complex g*g.
                grads, stored_mu, stored_nu = (
                    [_real(x, c) for x, c in zip(xs, complex_leaves, strict=True)]
                    for xs in (grads, stored_mu, stored_nu)
                )
            mu, nu = stored_mu, stored_nu
            if upcast:
                grads = [g.to(torch.promote_types(g.dtype, torch.float32)) for g in grads]
                mu = [m.to(g.dtype) for m, g in zip(mu, grads, strict=True)]
                nu = [v.to(g.dtype) for v, g in zip(nu, grads, strict=True)]
            mu = foreach_lerp(mu, grads, 1.0 - b1)
            nu = torch._foreach_mul(nu, b2)
            torch._foreach_addcmul_(nu, grads, grads, 1.0 - b2)
            denom = torch._foreach_div(nu, bias_correction2)
            if eps_root:
                torch._foreach_add_(denom, eps_root)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, eps)
            if nesterov:
                numer = torch._foreach_mul(mu, b1 / (1.0 - torch.pow(b1, t + 1.0)))
                torch._foreach_add_(numer, torch._foreach_mul(grads, (1.0 - b1) / bias_correction1))
            else:
                numer = torch._foreach_div(mu, bias_correction1)
            torch._foreach_div_(numer, denom)
            if upcast:
                mu = [m.to(s.dtype) for m, s in zip(mu, stored_mu, strict=True)]
                nu = [v.to(s.dtype) for v, s in zip(nu, stored_nu, strict=True)]
            if any(complex_leaves):
                numer, mu, nu = (
                    [
                        torch.view_as_complex(x) if c else x
                        for x, c in zip(xs, complex_leaves, strict=True)
                    ]
                    for xs in (numer, mu, nu)
                )
            return numer, mu, nu

        new_updates, mu, nu = by_kind(
            moments, leaves, tree.leaves(state.mu), tree.leaves(state.nu), outputs=3
        )
        new_state = ScaleByAdamState(
            count=count, mu=tree.with_leaves(updates, mu), nu=tree.with_leaves(updates, nu)
        )
        return tree.with_leaves(updates, new_updates), new_state

    return GradientTransformation(init, update)


def _real(x: torch.Tensor, is_complex: bool) -> torch.Tensor:
    """A complex ``x`` as ``torch.view_as_real(x)`` (a trailing dim of 2), others as they are."""
    return torch.view_as_real(x) if is_complex else x
