"""``masked`` with every mask form, its state layout, and its errors."""

from __future__ import annotations

import pytest
import torch

import d9d.optim as optim
from d9d.errors import OptimTreeMismatchError

PARAMS = {
    "embed.weight": torch.ones(4, 2),
    "layers.0.attn.bias": torch.ones(3),
    "layers.0.attn.weight": torch.ones(3, 2),
    "layers.0.norm.weight": torch.ones(2),
}
DECAYED = {"embed.weight", "layers.0.attn.weight"}

MASKS = {
    "regex": r"^(?!.*(bias|norm))",
    "regex_list": [r"^embed\.", r"attn\.weight$"],
    "callable": lambda path, param: param.ndim >= 2,
    "pytree": {path: path in DECAYED for path in PARAMS},
}


@pytest.mark.parametrize("kind", MASKS)
def test_masked_applies_inner_to_selected_leaves_only(kind: str) -> None:
    opt = optim.masked(optim.scale(-3.0), MASKS[kind])
    updates = {path: torch.full_like(p, 2.0) for path, p in PARAMS.items()}
    new_updates, _ = opt.update(updates, opt.init(PARAMS), PARAMS)
    for path, update in new_updates.items():
        expected = -6.0 if path in DECAYED else 2.0
        assert torch.equal(update, torch.full_like(update, expected)), path


def test_masked_state_holds_none_for_unselected_params() -> None:
    opt = optim.masked(optim.scale_by_adam(), MASKS["regex"])
    state = opt.init(PARAMS)
    assert isinstance(state, optim.MaskedState)
    mu = state.inner_state.mu
    assert {path for path, leaf in mu.items() if leaf is not None} == DECAYED
    assert mu["layers.0.attn.bias"] is None
    _, state = opt.update(PARAMS, state, PARAMS)
    assert state.inner_state.mu["layers.0.norm.weight"] is None
    assert int(state.inner_state.count) == 1


def test_masked_without_params_selects_from_the_updates() -> None:
    opt = optim.masked(optim.scale(0.0), lambda path, update: update.ndim == 1)
    new_updates, _ = opt.update(PARAMS, opt.init(PARAMS))
    assert new_updates["layers.0.attn.bias"].sum() == 0
    assert new_updates["embed.weight"].sum() == 8


def test_masked_everything_out_is_a_no_op() -> None:
    opt = optim.masked(optim.scale_by_adam(), r"^no_such_param$")
    new_updates, state = opt.update(PARAMS, opt.init(PARAMS), PARAMS)
    assert all(new_updates[path] is PARAMS[path] for path in PARAMS)
    assert int(state.inner_state.count) == 1


@pytest.mark.parametrize("mask", [[], ()], ids=["list", "tuple"])
def test_an_empty_list_of_regexes_selects_nothing(mask) -> None:
    # It was taken for a pytree mask and refused as not laid out like the params.
    opt = optim.adamw(0.1, weight_decay=0.5, mask=mask)
    decayed, _ = opt.update(PARAMS, opt.init(PARAMS), PARAMS)
    plain = optim.adamw(0.1, weight_decay=0.0)
    undecayed, _ = plain.update(PARAMS, plain.init(PARAMS), PARAMS)
    assert all(torch.equal(decayed[path], undecayed[path]) for path in PARAMS)


def test_nested_masks_compose() -> None:
    inner = optim.masked(optim.scale(10.0), {path: path.startswith("embed") for path in PARAMS})
    opt = optim.masked(inner, MASKS["regex"])
    new_updates, _ = opt.update(PARAMS, opt.init(PARAMS), PARAMS)
    assert new_updates["embed.weight"].max() == 10.0
    assert new_updates["layers.0.attn.weight"].max() == 1.0


def test_mask_pytree_not_laid_out_like_params_is_an_error() -> None:
    mask = {path: True for path in PARAMS if path != "embed.weight"} | {"lm_head.weight": False}
    opt = optim.masked(optim.scale(2.0), mask)
    with pytest.raises(
        OptimTreeMismatchError,
        match=r"missing=\['embed.weight'\].*unexpected=\['lm_head.weight'\]",
    ):
        opt.init(PARAMS)


def test_mask_pytree_with_non_bool_leaf_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"must have bool leaves, got \{'w': 1\}"):
        optim.masked(optim.scale(2.0), {"w": 1})


def test_mask_callable_returning_a_tensor_is_an_error() -> None:
    opt = optim.masked(optim.scale(2.0), lambda path, param: param.sum() > 0)
    with pytest.raises(TypeError, match=r"returned tensor\(True\) for path='embed.weight'"):
        opt.init(PARAMS)


def test_mask_with_bad_regex_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"invalid regex pattern='\(bias'"):
        optim.masked(optim.scale(2.0), "(bias")


def test_masked_needs_a_transformation() -> None:
    with pytest.raises(TypeError, match=r"masked\(\) takes a GradientTransformation"):
        optim.masked(lambda x: x, r"bias")
