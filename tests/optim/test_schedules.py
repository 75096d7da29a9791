"""Schedules equal their closed forms, are 0-d float32 tensors, and validate their arguments."""

from __future__ import annotations

import math

import pytest
import torch

import d9d.optim as optim


def cosine(fraction: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * min(fraction, 1.0)))


# (schedule, closed form, steps): steps cover 0, the warmup boundary and past the decay end.
CASES = {
    "constant": (optim.constant(0.3), lambda t: 0.3, [0, 1, 10**9]),
    "linear_warmup": (
        optim.linear_warmup(2.0, 8, init_value=0.4),
        lambda t: 0.4 + (2.0 - 0.4) * min(t, 8) / 8,
        [0, 1, 7, 8, 9, 1000],
    ),
    "linear_warmup_zero_steps": (optim.linear_warmup(2.0, 0), lambda t: 2.0, [0, 1, 50]),
    "cosine_decay": (
        optim.cosine_decay(1.5, 10, alpha=0.1),
        lambda t: 1.5 * (0.9 * cosine(t / 10) + 0.1),
        [0, 3, 5, 9, 10, 11, 10**6],
    ),
    "warmup_cosine": (
        optim.warmup_cosine(3e-4, 100, 10_000, end_value=3e-5, init_value=1e-6),
        lambda t: (
            1e-6 + (3e-4 - 1e-6) * t / 100
            if t < 100
            else 3e-5 + (3e-4 - 3e-5) * cosine((t - 100) / 9_900)
        ),
        [0, 1, 99, 100, 101, 5050, 9_999, 10_000, 10_001, 2**40],
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_schedule_equals_closed_form(name: str) -> None:
    schedule, closed_form, steps = CASES[name]
    for step in steps:
        value = schedule(torch.tensor(step, dtype=torch.int64))
        assert value.shape == () and value.dtype == torch.float32, f"{name} at {step=}: {value!r}"
        expected = closed_form(step)
        assert math.isclose(value.item(), expected, rel_tol=1e-6, abs_tol=1e-12), (
            f"{name} at {step=}: {value.item()} != {expected}"
        )


def test_schedule_accepts_a_vector_of_steps() -> None:
    """Tensor ops only: a batch of steps evaluates elementwise, no Python branch on a value."""
    steps = torch.arange(0, 12)
    values = optim.warmup_cosine(1.0, 4, 10)(steps)
    expected = [optim.warmup_cosine(1.0, 4, 10)(torch.tensor(int(t))) for t in steps]
    torch.testing.assert_close(values, torch.stack(expected))


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: optim.linear_warmup(1.0, -1), r"warmup_steps=-1"),
        (lambda: optim.linear_warmup(1.0, 2.5), r"warmup_steps=2\.5"),
        (lambda: optim.warmup_cosine(1.0, -3, 10), r"warmup_steps=-3"),
        (lambda: optim.warmup_cosine(1.0, 10, 10), r"decay_steps=10 and warmup_steps=10"),
        (lambda: optim.cosine_decay(1.0, 0), r"decay_steps=0"),
        (lambda: optim.cosine_decay(1.0, 10, alpha=1.5), r"alpha=1\.5"),
        (lambda: optim.constant(float("nan")), r"value must be a finite real number, got nan"),
        (lambda: optim.linear_warmup("3e-4", 10), r"peak must be a finite real number"),
    ],
)
def test_schedule_rejects_bad_arguments(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()
