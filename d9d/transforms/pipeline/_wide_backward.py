"""The gathers' backward fed grads wider than the tensors they gathered.

A stage sums its weights' grads in their accumulated dtype (``_grad_sums``): float32 sums of
bf16 weights. ``torch.autograd.grad(gathered, stored, sums)`` would round them to bf16
first: the engine casts each grad to the dtype of the output it is given for
(``validate_outputs``), before the gather's backward, which casts it to the reduce dtype.
d9d's gathers are autograd functions whose backward takes grads of any float dtype and
casts them to the reduce dtype itself, so :func:`grads_of_stored` calls that backward with
the sums, one call per gather, and hands what it returns to autograd from the gather's
inputs on: the sums reach the reduction unrounded. A gather that is no autograd function is
refused, naming the dtypes that would make the sums the compute dtype (:func:`summed_narrow`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node

from ...core._param_plan import ParamPlan
from ...errors import PlanError

__all__ = ["grads_of_stored", "summed_narrow"]


def grads_of_stored(
    entries: Sequence[ParamPlan],
    gathered: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    stored: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """``torch.autograd.grad(gathered, stored, grads)`` (unused stored get zeros), where a
    grad may be of a wider dtype than its gathered tensor (of the params ``entries`` plan)."""
    wide: dict[Node, dict[int, torch.Tensor]] = {}
    for entry, tensor, grad in zip(entries, gathered, grads, strict=True):
        if grad.dtype == tensor.dtype:
            continue
        node = tensor.grad_fn
        if not isinstance(node, BackwardCFunction):
            compute, reduce = entry.compute_dtype or entry.dtype, entry.reduce_dtype or entry.dtype
            backward = (
                "none: the stored tensor is used ungathered"
                if node is None
                else f"{type(node).__name__}, not an autograd function's"
            )
            raise PlanError(
                f"pipeline sums the grad of {entry.path!r} in {grad.dtype} (the widest of its "
                f"stored {entry.dtype}, compute {compute} and reduce {reduce} dtypes), wider "
                f"than the {tensor.dtype} tensor its gather made, and reduces it through that "
                f"gather's backward, which is {backward}; gather it with a "
                "torch.autograd.Function whose backward takes a grad of any float dtype, as "
                f"d9d's gathers do, or {summed_narrow(entry)}"
            )
        wide.setdefault(node, {})
    outputs: list[torch.Tensor | GradientEdge] = []
    grad_outputs: list[torch.Tensor] = []
    for tensor, grad in zip(gathered, grads, strict=True):
        if tensor.grad_fn in wide:  # with every other output of its gather
            wide[tensor.grad_fn][tensor.output_nr] = grad
        else:
            outputs.append(tensor)
            grad_outputs.append(grad)
    with torch.no_grad():
        for node, given in wide.items():
            # As the engine calls it: a zero grad for an output that has none.
            inputs = [
                given[i] if i in given else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
                for i, m in enumerate(node._input_metadata)
            ]
            returned = node.apply(*inputs)  # one per forward argument
            # The arguments that need a grad are, in order, the inputs with an edge.
            edges = [(after, index) for after, index in node.next_functions if after is not None]
            needed = [g for g, need in zip(returned, node.needs_input_grad, strict=True) if need]
            for (after, index), grad in zip(edges, needed, strict=True):
                if grad is not None:
                    outputs.append(GradientEdge(after, index))
                    grad_outputs.append(grad)
    return torch.autograd.grad(
        outputs,
        list(stored),
        grad_outputs=grad_outputs,
        allow_unused=True,
        materialize_grads=True,
    )


def summed_narrow(entry: ParamPlan) -> str:
    """What makes ``entry``'s microbatch sums, in the widest of its stored, compute and
    reduce dtypes (``d9d/core/_accumulated_dtype.py``), its compute dtype where they are
    wider: a reduce dtype of the compute dtype only where the stored dtype is no wider."""
    stored = entry.dtype
    compute = entry.compute_dtype or stored
    if torch.promote_types(stored, compute) == compute:
        return f"reduce in the compute dtype (shard_params(reduce_dtype={compute}))"
    fix = "compute in the stored dtype (shard_params(param_dtype=None))"
    if torch.promote_types(stored, entry.reduce_dtype or stored) != stored:
        fix = (
            "compute and reduce in the stored dtype "
            "(shard_params(param_dtype=None, reduce_dtype=None))"
        )
    return f"{fix}: the sums are no narrower than the stored dtype, whatever the reduce dtype"
