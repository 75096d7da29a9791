"""``replace_activation``: where the runtime protocol finds a module's activation input;
``ApplyCall.override``: what a call sets is undone after it."""

from __future__ import annotations

import pytest
import torch

import d9d
from d9d.core._runtime import ApplyCall, replace_activation
from d9d.errors import PlanError
from d9d.models import MoE, MoEConfig
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


def test_an_override_of_a_method_leaves_the_module_as_it_was() -> None:
    """``expert_parallel`` sets an MoE layer's ``dispatch`` (a method) for one call: after
    it the layer has no instance attribute of that name; an instance attribute (``Experts.gemm``)
    gets its value back."""
    model = d9d.functionalize(MoE(MoEConfig.tiny()))
    layer = model.module.layers[1].mlp
    gemm = layer.experts.gemm
    call = ApplyCall(model.structure, None, model.params, (), {})
    call.override(layer, "dispatch", lambda x, ids, weights: x)
    call.override(layer.experts, "gemm", None)
    with call.environment():
        assert layer.dispatch(1, 2, 3) == 1 and layer.experts.gemm is None
    assert "dispatch" not in vars(layer) and layer.dispatch.__func__ is type(layer).dispatch
    assert layer.experts.gemm is gemm
