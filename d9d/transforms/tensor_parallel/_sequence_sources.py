"""Which params the residual stream was computed from when sequence parallelism slices it.

[Note: params before the first block] The first block slices the residual stream over the
sequence, and the slice's backward all-gathers its grad: every rank then holds the whole
grad of what came before, so a param that the stream was computed from (a learned position
embedding, a norm on the embedding) gets the whole grad on every rank, while its plan sums its
grad over the axis (as for a param the blocks or the head use on this rank's positions). The
runtime refuses such a param by name: when its module runs before the first block (an
interception, eager and under ``jit``), and, eagerly, by walking the stream's autograd graph
back to the params outside blocks when the first block starts, which also finds a param read
without a call of its module (``self.pos.weight[:S]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["sources"]


def sources(x: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The keys of ``tensors`` that ``x`` was computed from, in ``tensors``' order: a walk
    of ``x``'s autograd graph to each tensor's own node (a leaf's ``AccumulateGrad``, or the
    output of the node that made it)."""
    outputs: dict[tuple[Any, int], str] = {}
    leaves: dict[int, str] = {}
    for key, tensor in tensors.items():
        if not tensor.requires_grad:
            continue
        if tensor.grad_fn is None:
            leaves[id(tensor)] = key
        else:
            outputs.setdefault((tensor.grad_fn, tensor.output_nr), key)
    if x.grad_fn is None or not (outputs or leaves):
        return []
    found = {outputs[(x.grad_fn, x.output_nr)]} if (x.grad_fn, x.output_nr) in outputs else set()
    seen: set[Any] = set()
    stack = [x.grad_fn]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad's leaf
        if variable is not None and id(variable) in leaves:
            found.add(leaves[id(variable)])
        for following, output in node.next_functions:
            if following is not None:
                if (following, output) in outputs:
                    found.add(outputs[(following, output)])
                stack.append(following)
    return [key for key in tensors if key in found]
