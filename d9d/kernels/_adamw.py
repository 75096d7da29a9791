"""``adamw``: a fused in-place AdamW step over lists of tensors, and its Triton backend."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..errors import KernelInputError
from . import _reference
from ._checks import check_floating, check_same, check_shape
from ._registry import define_op, register_backend, resolve
from ._triton_env import TRITON_DTYPES, triton_auto, triton_unavailable

__all__ = ["adamw"]


@torch.library.custom_op("d9d::adamw_triton", mutates_args={"params", "exp_avgs", "exp_avg_sqs"})
def _update_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    lr: Tensor,
    step: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    from ._triton import adamw as kernels

    kernels.update_(params, grads, exp_avgs, exp_avg_sqs, lr, step, beta1, beta2, eps, weight_decay)


@_update_.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, lr, step, beta1, beta2, eps, weight_decay) -> None:
    return None


def _triton_adamw(params, grads, exp_avgs, exp_avg_sqs, *, lr, step, **hyper) -> None:
    _update_(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), lr, step, **hyper)


def _check(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    hyper: dict[str, float | Tensor],
) -> None:
    lengths = {
        "params": len(params),
        "grads": len(grads),
        "exp_avgs": len(exp_avgs),
        "exp_avg_sqs": len(exp_avg_sqs),
    }
    if len(set(lengths.values())) > 1:
        raise KernelInputError(f"adamw: the four lists must have one length, got {lengths}")
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        names = {f"params[{i}]": p, f"grads[{i}]": g, f"exp_avgs[{i}]": m, f"exp_avg_sqs[{i}]": v}
        check_floating("adamw", **names)
        check_same("adamw", "device", **names)
        for name, tensor in list(names.items())[1:]:
            check_shape("adamw", name, tensor, tuple(p.shape))
    for name in ("beta1", "beta2"):
        if not 0.0 <= hyper[name] < 1.0:
            raise KernelInputError(f"adamw: {name}={hyper[name]} must be in [0, 1)")
    for name in ("eps", "weight_decay"):
        if not hyper[name] >= 0.0:
            raise KernelInputError(f"adamw: {name}={hyper[name]} must be >= 0")
    step = hyper["step"]
    if not isinstance(step, Tensor) and not step >= 1:
        raise KernelInputError(
            f"adamw: step={step!r} must be >= 1: it numbers this update counting from 1 (the "
            "bias corrections divide by 1 - beta**step, 0 at step 0)"
        )


def _resolve_all(tensors: Sequence[Tensor], backend: str | None):
    """The backend for every tensor's device and dtype: resolved for each kind of tensor, so
    a forced backend that cannot take one (Triton and a float64 moment) is refused by name;
    the reference when automatic selection picks different ones for different kinds."""
    kinds = {(t.device.type, t.dtype): t for t in tensors}
    impls = {resolve("adamw", t, backend) for t in kinds.values()}
    return impls.pop() if len(impls) == 1 else _reference.adamw


def adamw(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    lr: float | Tensor,
    step: int | Tensor,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    backend: str | None = None,
) -> None:
    """One AdamW step, in place, over lists of tensors (``torch.optim.AdamW``'s formula).

    For each ``(p, g, m, v)``: ``m = beta1*m + (1-beta1)*g``, ``v = beta2*v + (1-beta2)*g**2``,
    ``p = p*(1 - lr*weight_decay) - lr/(1 - beta1**step) * m / (sqrt(v/(1 - beta2**step)) +
    eps)``, computed in float32 whatever the tensors' dtypes (bfloat16 params with float32
    moments work; float64 ones in float64). The bias corrections ``lr/(1 - beta1**step)`` and
    ``sqrt(1 - beta2**step)`` are computed in float64, as torch does (the reference computes
    ``1 - lr*weight_decay`` there too; Triton in float32, in the kernel). ``params``,
    ``exp_avgs`` and ``exp_avg_sqs`` are overwritten: use it on donated buffers. Runs without autograd. Pass ``lr`` and ``step`` as 0-d tensors under
    ``torch.compile`` so a new value does not recompile.

    Args:
        params: tensors to update.
        grads: their gradients, one per param, same shapes.
        exp_avgs: first moments, one per param, same shapes; updated in place.
        exp_avg_sqs: second moments, likewise.
        lr: learning rate, a float or a 0-d tensor.
        step: the number of this update, counting from 1 (int or 0-d tensor).
        beta1: first-moment decay; default 0.9.
        beta2: second-moment decay; default 0.999.
        eps: added to the denominator; default 1e-8.
        weight_decay: decoupled weight decay; default 0.
        backend: ``"reference"``, ``"triton"``, ``"auto"`` or None (see ``d9d.kernels.use``).

    Returns:
        None.

    Raises:
        KernelInputError: lists of different lengths, mismatched shapes or devices,
            non-float tensors, betas outside [0, 1), negative eps or weight decay, an int
            ``step`` below 1.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d.kernels as K
        >>> p, g = torch.ones(2), torch.ones(2)
        >>> m, v = torch.zeros(2), torch.zeros(2)
        >>> K.adamw([p], [g], [m], [v], lr=0.1, step=1)
        >>> p
        tensor([0.9000, 0.9000])
    """
    hyper = {"beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    _check(params, grads, exp_avgs, exp_avg_sqs, {**hyper, "step": step})
    if not params:
        return
    device = params[0].device
    # float64: the bias corrections are taken from these, and in float32 ``1 - 0.999**1`` is
    # 1.3e-5 off (0.999 itself rounds), which moved each param 40 ulps from torch.optim.AdamW
    # over 50 steps (torch computes them in Python floats, i.e. float64).
    lr = torch.as_tensor(lr, dtype=torch.float64, device=device)
    step = torch.as_tensor(step, dtype=torch.float64, device=device)
    impl = _resolve_all((*params, *grads, *exp_avgs, *exp_avg_sqs), backend)
    with torch.no_grad():
        impl(params, grads, exp_avgs, exp_avg_sqs, lr=lr, step=step, **hyper)


define_op("adamw", _reference.adamw)
register_backend(
    "adamw",
    "triton",
    _triton_adamw,
    dtypes=TRITON_DTYPES,
    unavailable=triton_unavailable,
    auto=triton_auto,
)
