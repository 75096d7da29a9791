"""Gradient accumulation: ``d9d.value_and_grad`` over equal microbatches of the batch.

Each microbatch runs forward and backward with reductions deferred (the grads stay
``Partial``, summed locally) and weighs by the valid tokens its loss counted
(:func:`d9d.losses.token_mean`), applied to its loss before its backward; the sums are divided
by the step's total once, so the value is the mean over all of the step's tokens. A loss that
counts none gives every microbatch the same weight.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core._autodiff import stack_aux
from ...core._context import current
from ...core._runtime import Differentiation

__all__ = ["accumulate"]


def accumulate(job: Differentiation, microbatches: int) -> tuple[torch.Tensor, Any, list[Any]]:
    """``(value, aux, grads)`` of ``job`` over ``microbatches`` equal slices of its batch."""
    step = current()
    assert step is not None
    values, weights, auxes, total = [], [], [], None
    previous, step.defer_reduction = step.defer_reduction, True
    try:
        for args, kwargs in job.split(microbatches):
            value, aux, grads, weight = job.run(args, kwargs, True)
            values.append(value if weight is None else value * weight)
            weights.append(weight)
            auxes.append(aux)
            total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
    finally:
        step.defer_reduction = previous
    if any(w is None for w in weights) and any(w is not None for w in weights):
        raise TypeError(
            "the loss counted its tokens (d9d.losses.token_mean) in some microbatches and "
            "not in others; compute it the same way in every microbatch"
        )
    count = microbatches if weights[0] is None else torch.stack(weights).sum().clamp(min=1)
    grads = [g / count for g in total]
    aux = stack_aux(auxes, weights) if job.has_aux else None
    return torch.stack(values).sum() / count, aux, grads
