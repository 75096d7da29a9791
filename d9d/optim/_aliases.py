"""Ready-made optimizers: each is only a ``chain`` of primitives, with no math of its own."""

from __future__ import annotations

import torch

from d9d.optim._adam import scale_by_adam
from d9d.optim._checks import check_bool, check_non_negative
from d9d.optim._lion import scale_by_lion
from d9d.optim._masking import Mask
from d9d.optim._momentum import trace
from d9d.optim._scaling import add_decayed_weights, scale_by_learning_rate
from d9d.optim._schedules import Schedule
from d9d.optim._transform import GradientTransformation, chain

__all__ = ["adam", "adamw", "lion", "sgd"]


def adamw(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    eps_root: float = 0.0,
    nesterov: bool = False,
    mask: Mask | None = None,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """AdamW (Loshchilov & Hutter), matching ``torch.optim.AdamW``.

    ``chain(scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov),
    add_decayed_weights(weight_decay, mask), scale_by_learning_rate(learning_rate))``: the
    decay is decoupled from the moments and scaled by the learning rate.

    Args:
        learning_rate: a float or a schedule of the step.
        b1, b2, eps, eps_root, nesterov: as ``scale_by_adam``.
        mu_dtype, nu_dtype: the moments' storage dtypes, as ``scale_by_adam`` (default None:
            each param's dtype); ``torch.bfloat16`` halves the state, the math stays float32.
        weight_decay: decoupled decay coefficient (default 1e-2, torch's default).
        mask: which params are decayed, as ``masked`` takes it; ``None`` decays all.
            ``r"^(?!.*(bias|norm))"`` skips biases and norms.

    Returns:
        A ``GradientTransformation`` whose state is a 3-tuple of the primitives' states.

    Raises:
        ValueError: a hyperparameter is out of range (see the primitives).

    Example:
        >>> import torch
        >>> opt = adamw(1e-3, weight_decay=0.1, mask=r"weight$")
        >>> params = {"fc.bias": torch.zeros(2), "fc.weight": torch.ones(2, 2)}
        >>> updates, state = opt.update(params, opt.init(params), params)
        >>> adamw(1e-3, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16).init(params)[0].nu
        {'fc.bias': tensor([0., 0.], dtype=torch.bfloat16), 'fc.weight': tensor([[0., 0.],
                [0., 0.]], dtype=torch.bfloat16)}
    """
    return chain(
        scale_by_adam(
            b1, b2, eps, eps_root, nesterov=nesterov, mu_dtype=mu_dtype, nu_dtype=nu_dtype
        ),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


def adam(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    eps_root: float = 0.0,
    nesterov: bool = False,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Adam (Kingma & Ba), matching ``torch.optim.Adam`` without weight decay.

    ``chain(scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov),
    scale_by_learning_rate(learning_rate))``. For weight decay use ``adamw``.

    Args:
        learning_rate: a float or a schedule of the step.
        b1, b2, eps, eps_root, nesterov, mu_dtype, nu_dtype: as ``scale_by_adam``.

    Returns:
        A ``GradientTransformation`` whose state is a 2-tuple of the primitives' states.

    Raises:
        ValueError: a hyperparameter is out of range (see the primitives).

    Example:
        >>> import torch
        >>> opt = adam(0.1)
        >>> params = {"w": torch.zeros(2)}
        >>> opt.update({"w": torch.tensor([1.0, -1.0])}, opt.init(params))[0]["w"]
        tensor([-0.1000,  0.1000])
    """
    return chain(
        scale_by_adam(
            b1, b2, eps, eps_root, nesterov=nesterov, mu_dtype=mu_dtype, nu_dtype=nu_dtype
        ),
        scale_by_learning_rate(learning_rate),
    )


def sgd(
    learning_rate: float | Schedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    mask: Mask | None = None,
) -> GradientTransformation:
    """SGD with optional momentum, matching ``torch.optim.SGD`` (``dampening=0``).

    ``chain(add_decayed_weights(weight_decay, mask), trace(momentum, nesterov),
    scale_by_learning_rate(learning_rate))``; the decay is an L2 term added to the gradient
    before the momentum, as in torch. ``trace`` is left out when ``momentum == 0``.

    Args:
        learning_rate: a float or a schedule of the step.
        momentum: the momentum coefficient, >= 0 (default 0.0: plain SGD).
        nesterov: use Nesterov momentum (needs ``momentum > 0``).
        weight_decay: L2 coefficient (default 0.0).
        mask: which params are decayed, as ``masked`` takes it; ``None`` decays all.

    Returns:
        A ``GradientTransformation`` whose state is a tuple of the primitives' states.

    Raises:
        ValueError: a hyperparameter is out of range, ``nesterov`` is not a bool (torch's
            positional order would put ``dampening`` there), or ``nesterov`` without momentum.

    Example:
        >>> import torch
        >>> opt = sgd(0.5, momentum=0.9)
        >>> params = {"w": torch.zeros(1)}
        >>> opt.update({"w": torch.ones(1)}, opt.init(params), params)[0]["w"]
        tensor([-0.5000])
    """
    check_non_negative("momentum", momentum)
    check_bool("nesterov", nesterov)
    if nesterov and momentum == 0:
        raise ValueError(
            f"nesterov=True needs a momentum, got {momentum=}; pass momentum > 0 or nesterov=False"
        )
    momentum_step = () if momentum == 0 else (trace(momentum, nesterov),)
    return chain(
        add_decayed_weights(weight_decay, mask),
        *momentum_step,
        scale_by_learning_rate(learning_rate),
    )


def lion(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 1e-1,
    *,
    mask: Mask | None = None,
) -> GradientTransformation:
    """Lion (Chen et al. 2023): the sign of an interpolated momentum, with decoupled decay.

    ``chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate))``, so a step is
    ``p -= lr * (sign(b1 m + (1 - b1) g) + weight_decay * p)``.

    Args:
        learning_rate: a float or a schedule of the step (typically 3-10x below AdamW's).
        b1, b2: as ``scale_by_lion``.
        weight_decay: decoupled decay coefficient (default 0.1: 10x ``adamw``'s, so that with
            a 10x smaller learning rate ``lr * weight_decay`` stays the same, as the paper
            advises).
        mask: which params are decayed, as ``masked`` takes it; ``None`` decays all.

    Returns:
        A ``GradientTransformation`` whose state is a 3-tuple of the primitives' states.

    Raises:
        ValueError: a hyperparameter is out of range (see the primitives).

    Example:
        >>> import torch
        >>> opt = lion(0.1, weight_decay=0.0)
        >>> params = {"w": torch.zeros(2)}
        >>> opt.update({"w": torch.tensor([2.0, -3.0])}, opt.init(params), params)[0]["w"]
        tensor([-0.1000,  0.1000])
    """
    return chain(
        scale_by_lion(b1, b2),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
