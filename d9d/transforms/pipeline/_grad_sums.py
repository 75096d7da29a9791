"""A stage's weight grads summed over the step's microbatches in their accumulated dtype.

A stage weight is the gathered compute tensor (bf16 under ``param_dtype=torch.bfloat16``),
and torch's schedules sum its microbatches' grads into its ``.grad``, in its dtype. Where the
grad's accumulated dtype is wider (``d9d.core._accumulated_dtype``: the widest of the stored,
compute and reduce dtypes, float32 for float32 params computed in bf16), :class:`GradSums`
moves each microbatch's grad into a sum of that dtype as soon as the schedule has put it in
``.grad``, and clears ``.grad``, as ``shard_params(microbatches=k)`` sums its grads: one
float32 sum per weight, beside one
microbatch's grad of one weight at a time (a 1F1B-style backward, through
``register_post_accumulate_grad_hook``) or of the stage (the zero-bubble weight pass,
which torch's ``stage_backward_weight`` adds to ``.grad`` after one ``autograd.grad`` for all
of them: :meth:`GradSums.take`, after the pass). Weights whose dtype is already the
accumulated one keep torch's ``.grad`` sums, untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["GradSums"]


class GradSums:
    """The sums of ``weights`` (path to stage weight) whose ``dtypes`` (path to accumulated
    dtype) differ from their own, for one step; :meth:`close` removes its hooks."""

    def __init__(self, weights: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype]):
        self.dtypes = {id(w): dtypes[p] for p, w in weights.items() if dtypes[p] != w.dtype}
        self.sums: dict[int, torch.Tensor] = {}
        self.handles = [
            w.register_post_accumulate_grad_hook(self._take_one)
            for w in weights.values()
            if id(w) in self.dtypes
        ]

    def take(self, weights: Iterable[torch.Tensor]) -> None:
        """Move the ``.grad`` of each of ``weights`` that has one into its sum."""
        for weight in weights:
            if weight.grad is not None and id(weight) in self.dtypes:
                self._take_one(weight)

    def grad(self, weight: torch.Tensor) -> torch.Tensor | None:
        """``weight``'s grad summed over the microbatches (None: no microbatch made one)."""
        return self.sums.get(id(weight)) if id(weight) in self.dtypes else weight.grad

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _take_one(self, weight: torch.Tensor) -> None:
        grad, weight.grad = weight.grad, None
        total = self.sums.get(id(weight))
        if total is None:  # a copy: the grad may be a tensor autograd handed elsewhere too
            self.sums[id(weight)] = grad.to(self.dtypes[id(weight)])
        else:
            total.add_(grad)
