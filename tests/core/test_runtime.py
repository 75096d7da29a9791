"""``replace_activation``: where the runtime protocol finds a module's activation input."""

from __future__ import annotations

import pytest
import torch

from d9d.core._runtime import replace_activation
from d9d.errors import PlanError
from d9d.models.moe import MoEState


def test_the_activation_is_the_first_tensor_of_a_carried_state() -> None:
    x, aux, load = torch.ones(2, 3), torch.tensor(0.5), torch.zeros(1, 4)
    (state, cos), _ = replace_activation((MoEState(x, aux, load), "cos"), {}, "b", lambda t: 2 * t)
    assert type(state) is MoEState and cos == "cos"
    assert state.x.eq(2).all() and state.aux_loss is aux and state.load is load
    (plain,), _ = replace_activation(((x, aux),), {}, "b", lambda t: t + 1)
    assert type(plain) is tuple and plain[0].eq(2).all() and plain[1] is aux
    args, kwargs = replace_activation((), {"hidden_states": x}, "b", lambda t: -t)
    assert args == () and kwargs["hidden_states"].eq(-1).all()


def test_a_module_without_an_activation_input_is_named() -> None:
    with pytest.raises(PlanError, match=r"activation input of module 'layers\.0'.*first tensor"):
        replace_activation(("tokens",), {}, "layers.0", lambda t: t)
