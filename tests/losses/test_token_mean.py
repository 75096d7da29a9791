"""``d9d.losses.token_mean`` on one process."""

from __future__ import annotations

import doctest

import pytest
import torch

import d9d
from d9d.losses import _token_mean


def test_docstring_example() -> None:
    assert doctest.testmod(_token_mean, extraglobs={"torch": torch}).failed == 0


def test_masked_mean_and_zero_without_valid_tokens() -> None:
    values = torch.tensor([1.0, 2.0, 6.0], requires_grad=True)
    mean = d9d.losses.token_mean(values, torch.tensor([True, False, True]))
    assert mean.item() == 3.5
    empty = d9d.losses.token_mean(values, torch.zeros(3, dtype=torch.bool))
    (grad,) = torch.autograd.grad(empty, values)
    assert empty.item() == 0.0 and torch.equal(grad, torch.zeros(3))


@pytest.mark.parametrize(
    "valid", [torch.ones(3), torch.ones(2, dtype=torch.bool)], ids=["float", "shape"]
)
def test_a_mask_that_is_not_boolean_or_not_shaped_like_the_values_is_refused(valid) -> None:
    with pytest.raises(ValueError, match="token_mean needs a boolean mask shaped like"):
        d9d.losses.token_mean(torch.ones(3), valid)


@pytest.mark.parametrize(
    ("dtype", "n", "value"),
    [(torch.float16, 40_000, 2.0), (torch.bfloat16, 257, 1.0)],
    ids=["float16", "bfloat16"],
)
def test_half_values_are_averaged_in_float32(dtype: torch.dtype, n: int, value: float) -> None:
    """Summed in their own dtype, 40,000 float16 twos overflowed to inf, and 257 bfloat16
    ones summed to 256 (a mean of 0.9961); ``Tensor.mean`` gives 2 and 1."""
    values = torch.full((n,), value, dtype=dtype, requires_grad=True)
    mean = d9d.losses.token_mean(values, torch.ones(n, dtype=torch.bool))
    (grad,) = torch.autograd.grad(mean, values)
    assert mean.dtype == torch.float32 and mean.item() == value
    assert grad.dtype == dtype and torch.equal(grad, torch.full_like(values, 1 / n))
