"""Microbatches of one ``d9d.value_and_grad`` call, summed: what a runtime that accumulates
(``shard_params(microbatches=k)``, ``fault_tolerant(manager, microbatches=k)``) divides, or
reduces further, before it hands the grads back.

Each microbatch runs forward and backward with its grads weighed by the valid tokens its loss
counted (:func:`d9d.losses.token_mean`), applied to its loss before its backward, so the sums
divided by the total count are the mean over every token of the call. A loss that counts
none gives every microbatch the same weight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ._autodiff import stack_aux
from ._context import current
from ._gather import local_like
from ._runtime import Differentiation

__all__ = ["sum_microbatches"]


def sum_microbatches(
    job: Differentiation, microbatches: int, *, defer_reduction: bool
) -> tuple[torch.Tensor, Any, list[Any], torch.Tensor | None]:
    """``(value_sum, aux, grad_sums, count)`` of ``job`` over ``microbatches`` equal slices
    of its inputs: the sums of each microbatch's value and grads, both weighed by its
    valid-token count, and the sum of the counts (None when the loss counts no tokens: then
    the sums are unweighted). ``aux`` is stacked over the microbatches, weighed alike.

    Args:
        job: The differentiation a runtime drives.
        microbatches: How many slices (dim 0 of every input).
        defer_reduction: Leave the gathered params' grads unreduced (``Partial``) through
            every microbatch, for ``value_and_grad`` to reduce their sum once; False reduces
            each microbatch's grads as its backward ends.

    Raises:
        TypeError: The loss counted its tokens in some microbatches and not in others.
    """
    step = current()
    assert step is not None
    values, weights, auxes, total = [], [], [], None
    previous, step.defer_reduction = step.defer_reduction, defer_reduction
    try:
        for args, kwargs in job.split(microbatches):
            value, aux, grads, weight = job.run(args, kwargs, True, total)
            values.append(value if weight is None else value * weight)
            weights.append(weight)
            auxes.append(aux)
            total = _owned(grads) if total is None else _added(total, grads)
    finally:
        step.defer_reduction = previous
    if any(w is None for w in weights) and any(w is not None for w in weights):
        raise TypeError(
            "the loss counted its tokens (d9d.losses.token_mean) in some microbatches and "
            "not in others; compute it the same way in every microbatch"
        )
    count = None if weights[0] is None else torch.stack(weights).sum()
    aux = stack_aux(auxes, weights) if job.has_aux else None
    return torch.stack(values).sum(), aux, total, count


def _owned(grads: list[Any]) -> list[Any]:
    """The first microbatch's ``grads`` copied, one at a time, into buffers of their own that
    later microbatches are added into in place: a grad the backward returned may share its
    tensor with another param's (one op can hand the same grad to two inputs) or be a
    broadcast's expanded view, which an in-place add would corrupt or refuse."""
    for i, grad in enumerate(grads):
        # The local tensor's copy: DTensor's own clone reduces a Partial grad.
        grads[i] = (
            local_like(grad.to_local().clone(), grad) if isinstance(grad, DTensor) else grad.clone()
        )
    return grads


def _added(total: list[Any], grads: list[Any]) -> list[Any]:
    """``total`` plus ``grads``, element by element. The backward has added each grad of
    ``total``'s layout into it in place and returned it (``Differentiation.run``'s
    ``into``); one it did not (an unused param's zeros) is added here."""
    for i, grad in enumerate(grads):
        if grad is not total[i]:
            total[i] = total[i] + grad
        grads[i] = None
    return total
