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
