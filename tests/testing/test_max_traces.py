from __future__ import annotations

import pytest
import torch

from d9d.testing import assert_max_traces


def test_counts_traces_of_a_compiled_function_and_fails_past_n() -> None:
    double = assert_max_traces(torch.compile(lambda x: 2 * x, backend="eager", dynamic=False), n=1)
    double(torch.ones(3))
    double(torch.zeros(3))
    assert double.traces == 1
    with pytest.raises(AssertionError, match=r"was traced 2 times, at most 1 allowed"):
        double(torch.ones(4))


def test_decorator_form_allows_n_traces() -> None:
    @assert_max_traces(n=2)
    @torch.compile(backend="eager", dynamic=False)
    def square(x: torch.Tensor) -> torch.Tensor:
        return x * x

    square(torch.ones(2))
    square(torch.ones(3))
    assert square.traces == 2


def test_n_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"needs n >= 1 traces, got n=0"):
        assert_max_traces(lambda: None, n=0)
