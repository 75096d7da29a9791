"""``get_state`` reads the current learning rate and step count from any optimizer state."""

from __future__ import annotations

import pytest
import torch

import d9d.optim as optim
from d9d.errors import UnknownStateNameError

PARAMS = {"fc.bias": torch.zeros(3), "fc.weight": torch.zeros(3, 2)}


def run(opt: optim.GradientTransformation, steps: int):
    state = opt.init(PARAMS)
    for _ in range(steps):
        grads = {path: torch.ones_like(p) for path, p in PARAMS.items()}
        _, state = opt.update(grads, state, PARAMS)
    return state


OPTIMIZERS = {
    "adamw": lambda lr: optim.adamw(lr, mask=r"weight$"),
    "sgd_momentum": lambda lr: optim.sgd(lr, momentum=0.9),
    "clipped_lion": lambda lr: optim.chain(optim.clip_by_global_norm(1.0), optim.lion(lr)),
    "masked_adam": lambda lr: optim.masked(optim.adam(lr), r"weight$"),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_get_state_reads_the_last_learning_rate_and_the_count(name: str) -> None:
    schedule = optim.linear_warmup(1.0, 10)
    state = run(OPTIMIZERS[name](schedule), steps=4)
    # The 4th update (count 3 before it) applied schedule(3) = 0.3.
    torch.testing.assert_close(optim.get_state(state, "learning_rate"), torch.tensor(0.3))
    assert optim.get_state(state, "count").item() == 4
    assert optim.get_state(state, "step").item() == 4


def test_get_state_at_init_reads_the_first_rate() -> None:
    state = optim.adamw(optim.linear_warmup(1.0, 10, init_value=0.05)).init(PARAMS)
    torch.testing.assert_close(optim.get_state(state, "learning_rate"), torch.tensor(0.05))
    assert optim.get_state(state, "count").item() == 0


def test_get_state_reads_per_param_fields() -> None:
    mu = optim.get_state(run(optim.adam(0.1), steps=1), "mu")
    torch.testing.assert_close(mu["fc.bias"], torch.full((3,), 0.1))


def test_get_state_unknown_name_lists_the_names_there_are() -> None:
    state = run(optim.sgd(0.1, momentum=0.9), steps=1)
    with pytest.raises(
        UnknownStateNameError,
        match=r"called 'lr'; this state has \['count', 'learning_rate', 'step', 'trace'\]",
    ):
        optim.get_state(state, "lr")
