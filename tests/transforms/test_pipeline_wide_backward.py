"""``_wide_backward.grads_of_stored``: float32 sums of bf16 gathered tensors reach the gather's
backward unrounded, and a gather that is no autograd function is refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from d9d.errors import PlanError
from d9d.transforms.pipeline._wide_backward import grads_of_stored


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
        ["a", "b", "c"],
        [first, second, third],
        [wide, torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)],
        stored,
    )
    assert torch.equal(grads[0], 2 * wide)  # through autograd: 2.0, the bf16 of 1 + 2^-12
    assert torch.equal(grads[1], torch.full((3,), 2.0))
    assert torch.equal(grads[2], torch.ones(3))


def test_a_wide_grad_through_no_autograd_function_is_refused() -> None:
    stored = torch.ones(3, requires_grad=True)
    with pytest.raises(
        PlanError,
        match=r"grad of 'w' in torch.float32, wider .*ToCopyBackward0.*reduce_dtype=torch.bfloat16",
    ):
        grads_of_stored(["w"], [stored.to(torch.bfloat16)], [torch.ones(3)], [stored])
