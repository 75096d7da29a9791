"""Gradient accumulation: ``d9d.value_and_grad`` over equal microbatches of the batch.

Each microbatch runs forward and backward with reductions deferred (the grads stay
``Partial``, summed locally) and weighed by the valid tokens its loss counted
(:func:`d9d.core._microbatches.sum_microbatches`); the sums are divided by the step's total
once, so the value is the mean over all of the step's tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core._microbatches import sum_microbatches
from ...core._runtime import Differentiation

__all__ = ["accumulate"]


def accumulate(
    job: Differentiation, microbatches: int
) -> tuple[torch.Tensor, Any, list[Any], torch.Tensor | None]:
    """``(value, aux, grads, weight)`` of ``job`` over ``microbatches`` equal slices of its
    batch: the mean over its ``weight`` valid tokens (None: the loss counted none)."""
    value, aux, grads, weight = sum_microbatches(job, microbatches, defer_reduction=True)
    count = microbatches if weight is None else weight.clamp(min=1)
    for grad in grads:  # in place: the sums are buffers of their own (sum_microbatches)
        grad.div_(count)
    return value / count, aux, grads, weight
