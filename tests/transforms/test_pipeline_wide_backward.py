"""``_wide_backward.grads_of_stored``: float32 sums of bf16 gathered tensors reach the gather's
backward unrounded, and a gather that is no autograd function is refused by name, with the
plan change that makes the sums the compute dtype."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from d9d.core._accumulated_dtype import accumulated_dtype
from d9d.core._param_plan import Cast, ParamPlan
from d9d.errors import PlanError
from d9d.transforms.pipeline._wide_backward import grads_of_stored

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16


def _entry(path: str, stored: torch.dtype, compute: torch.dtype, reduce: Any) -> ParamPlan:
    codec = None if compute == stored else Cast(compute)
    return ParamPlan(
        path, (3,), stored, None, (Shard(0),), (Replicate(),), (Partial("avg"),),
        codec=codec, reduce_dtype=reduce,
    )  # fmt: skip


class _CastGather(torch.autograd.Function):
    """A gather's shape: float32 stored in, bf16 out; the backward casts the grad to float32."""

    @staticmethod
    def forward(ctx: Any, label: str, *stored: torch.Tensor) -> tuple[torch.Tensor, ...]:
        del ctx, label  # a non-tensor argument first, as d9d's gathers take
        return tuple(s.to(torch.bfloat16) for s in stored)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, *(g.to(torch.float32) * 2 for g in grads))


def test_float32_sums_reach_the_gathers_backward_unrounded() -> None:
    """Two params gathered by one autograd function, one given a float32 grad (1 + 2^-12,
    which bf16 rounds to 1) and one a bf16 grad; a third through a plain cast with a grad of
    its own dtype: each stored grad is its gather's backward of the grad as given."""
    stored = [torch.ones(3, requires_grad=True) for _ in range(3)]
    first, second = _CastGather.apply("gather", stored[0], stored[1])
    third = stored[2].to(torch.bfloat16)
    wide = torch.full((3,), 1 + 2**-12)
    grads = grads_of_stored(
        [_entry(path, f32, bf16, None) for path in "abc"],
        [first, second, third],
        [wide, torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)],
        stored,
    )
    assert torch.equal(grads[0], 2 * wide)  # through autograd: 2.0, the bf16 of 1 + 2^-12
    assert torch.equal(grads[1], torch.full((3,), 2.0))
    assert torch.equal(grads[2], torch.ones(3))


# (stored, compute, reduce dtype, the fix the refusal names, that fix as plan fields)
_NARROWED = [
    # The stored dtype no wider than the compute one: reducing in it is enough.
    (bf16, bf16, f32,
     r"reduce in the compute dtype \(shard_params\(reduce_dtype=torch.bfloat16\)\)",
     {"reduce_dtype": bf16}),
    (f16, f32, torch.float64, r"\(shard_params\(reduce_dtype=torch.float32\)\)",
     {"reduce_dtype": f32}),
    # The stored dtype the widest: no reduce dtype narrows the sums (reduce_dtype=bf16 was
    # named here, and changed nothing).
    (f32, bf16, None, r"compute in the stored dtype \(shard_params\(param_dtype=None\)\): the "
     r"sums are no narrower than the stored dtype", {"codec": None}),
    (f32, bf16, bf16, r"\(shard_params\(param_dtype=None\)\)", {"codec": None}),
    # bf16 and float16 promote to float32: the reduce dtype must go too.
    (bf16, f16, f32, r"compute and reduce in the stored dtype "
     r"\(shard_params\(param_dtype=None, reduce_dtype=None\)\)",
     {"codec": None, "reduce_dtype": None}),
]  # fmt: skip


@pytest.mark.parametrize(("stored", "compute", "reduce", "fix", "fields"), _NARROWED)
def test_a_wide_grad_through_no_autograd_function_is_refused_with_the_fix(
    stored: torch.dtype,
    compute: torch.dtype,
    reduce: torch.dtype | None,
    fix: str,
    fields: dict[str, Any],
) -> None:
    """The grad is summed as the plan says; the refusal names the change that, applied to
    the plan, makes the sums the compute dtype (the rule's, ``accumulated_dtype``)."""
    entry = _entry("w", stored, compute, reduce)
    summed = accumulated_dtype(entry)
    assert summed != compute
    leaf = torch.ones(3, dtype=stored, requires_grad=True)
    gathered = leaf.to(compute)  # no autograd function: ToCopyBackward0, or the leaf itself
    node = (
        "none: the stored tensor is used ungathered"
        if gathered.grad_fn is None
        else f"{type(gathered.grad_fn).__name__}, not an autograd function's"
    )
    with pytest.raises(PlanError, match=rf"grad of 'w' in {summed} .*which is {node}; .*{fix}"):
        grads_of_stored([entry], [gathered], [torch.ones(3, dtype=summed)], [leaf])
    fixed = replace(entry, **fields)
    assert accumulated_dtype(fixed) == (fixed.compute_dtype or fixed.dtype)
