"""``chain``, ``apply_updates``, state layout and dtypes, argument errors, docstring examples."""

from __future__ import annotations

import doctest
import importlib
from collections import OrderedDict

import numpy as np
import pytest
import torch

import d9d.optim as optim
from d9d.errors import OptimTreeMismatchError


def test_chain_feeds_each_output_to_the_next_and_tuples_the_states() -> None:
    opt = optim.chain(optim.scale(2.0), optim.clip_by_global_norm(1.0), optim.scale(-1.0))
    params = {"a": torch.zeros(1), "b": torch.zeros(1)}
    updates, state = opt.update(
        {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}, opt.init(params)
    )
    assert state == (optim.ScaleState(), optim.ClipByGlobalNormState(), optim.ScaleState())
    torch.testing.assert_close(updates, {"a": torch.tensor([-0.6]), "b": torch.tensor([-0.8])})


def test_clip_leaves_small_updates_unchanged() -> None:
    clip = optim.clip_by_global_norm(10.0)
    updates = {"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])}
    torch.testing.assert_close(clip.update(updates, clip.init(updates))[0], updates)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_clip_of_non_finite_updates_is_clip_grad_norm_s(bad: float) -> None:
    """As torch's default (``error_if_nonfinite=False``): a NaN makes every update NaN; an
    infinity makes the norm inf, the factor 0, the finite updates 0 and the infinite NaN."""
    updates = {"a": torch.tensor([1.0, bad]), "b": torch.tensor([3.0, 4.0])}
    clip = optim.clip_by_global_norm(1.0)
    theirs = [torch.zeros(2, requires_grad=True) for _ in updates]
    for param, update in zip(theirs, updates.values(), strict=True):
        param.grad = update.clone()
    norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    torch.testing.assert_close(optim.global_norm(updates), norm, equal_nan=True)
    clipped = clip.update(updates, clip.init(updates))[0]
    for got, param in zip(clipped.values(), theirs, strict=True):
        torch.testing.assert_close(got, param.grad, rtol=0, atol=0, equal_nan=True)


def test_adam_state_mirrors_params_with_a_0d_count() -> None:
    params = {"w": torch.zeros(5, 3), "b": torch.zeros(7)}
    state = optim.scale_by_adam().init(params)
    assert isinstance(state, optim.ScaleByAdamState)
    assert state.count.shape == () and state.count.dtype == torch.int64
    assert set(state.mu) == set(state.nu) == {"w", "b"}
    assert state.mu["w"].shape == (5, 3)


def test_bf16_params_keep_their_dtype_in_state_and_after_apply() -> None:
    params = {"w": torch.randn(4, 3, dtype=torch.bfloat16)}
    opt = optim.adamw(1e-2)
    state = opt.init(params)
    assert state[0].mu["w"].dtype == state[0].nu["w"].dtype == torch.bfloat16
    updates, state = opt.update({"w": torch.randn(4, 3, dtype=torch.bfloat16)}, state, params)
    new_params = optim.apply_updates(params, updates)
    assert new_params["w"].dtype == torch.bfloat16
    fp32_updates = {"w": torch.ones(4, 3)}
    assert optim.apply_updates(params, fp32_updates)["w"].dtype == torch.bfloat16


def test_apply_updates_returns_new_tensors() -> None:
    params = {"w": torch.ones(3)}
    new_params = optim.apply_updates(params, {"w": torch.ones(3)})
    assert torch.equal(params["w"], torch.ones(3))
    assert torch.equal(new_params["w"], torch.full((3,), 2.0))


def test_apply_updates_on_a_mismatched_tree_is_an_error() -> None:
    with pytest.raises(OptimTreeMismatchError, match=r"missing=\['b'\].*unexpected=\['c'\]"):
        optim.apply_updates(
            {"a": torch.ones(1), "b": torch.ones(1)}, {"a": torch.ones(1), "c": torch.ones(1)}
        )
    with pytest.raises(OptimTreeMismatchError, match=r"missing=\['a.x'\].*unexpected=\['a'\]"):
        optim.apply_updates({"a": {"x": torch.ones(1)}}, {"a": torch.ones(1)})
    # The same paths in another order: what lines leaves up is their order (an OrderedDict).
    ordered, reordered = OrderedDict(a=torch.ones(1), b=torch.ones(2)), OrderedDict()
    reordered["b"], reordered["a"] = torch.ones(2), torch.ones(1)
    with pytest.raises(OptimTreeMismatchError, match="leaf 0 is 'a' in the params, 'b' in"):
        optim.apply_updates(ordered, reordered)


def test_apply_updates_lines_updates_up_with_params_by_path() -> None:
    """Laid out alike means the same leaf paths: the result takes the params' containers."""
    out = optim.apply_updates({"s": (torch.ones(1), torch.ones(1))}, {"s": [torch.ones(1)] * 2})
    assert isinstance(out["s"], tuple) and out["s"][1].item() == 2.0


def test_add_decayed_weights_needs_params() -> None:
    decay = optim.add_decayed_weights(0.1)
    with pytest.raises(ValueError, match=r"add_decayed_weights needs the params"):
        decay.update({"w": torch.ones(1)}, decay.init({"w": torch.ones(1)}))


def test_chain_rejects_a_non_transformation() -> None:
    with pytest.raises(TypeError, match=r"got .*position=1"):
        optim.chain(optim.scale(1.0), lambda updates: updates)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: optim.scale_by_adam(b1=1.0), ValueError, r"b1 is a decay rate .* got b1=1\.0"),
        (lambda: optim.adamw(1e-3, b2=-0.1), ValueError, r"b2=-0\.1"),
        (lambda: optim.adam(1e-3, eps=-1e-8), ValueError, r"eps=-1e-08"),
        (lambda: optim.adam(1e-3, eps_root=float("inf")), ValueError, r"eps_root=inf"),
        (lambda: optim.adamw(-1e-3), ValueError, r"learning_rate=-0\.001"),
        (lambda: optim.adamw("1e-3"), TypeError, r"learning_rate='1e-3'"),
        (lambda: optim.adamw(1e-3, weight_decay=-0.1), ValueError, r"weight_decay=-0\.1"),
        (
            lambda: optim.sgd(0.1, nesterov=True),
            ValueError,
            r"nesterov=True needs a momentum, got momentum=0\.0",
        ),
        (lambda: optim.sgd(0.1, momentum=-0.9), ValueError, r"momentum=-0\.9"),
        (lambda: optim.trace(0.0, nesterov=True), ValueError, r"got decay=0\.0"),
        (lambda: optim.lion(1e-4, b1=1.5), ValueError, r"b1=1\.5"),
        # torch's SGD(params, lr, momentum, dampening, ...) order put dampening 0.1 in
        # nesterov, which turned Nesterov on silently
        (lambda: optim.sgd(0.1, 0.9, 0.1), ValueError, r"nesterov is a switch .* nesterov=0\.1"),
        (lambda: optim.trace(0.9, nesterov=1), ValueError, r"nesterov=1"),
        (lambda: optim.adamw(1e-3, nesterov="no"), ValueError, r"nesterov='no'"),
        (lambda: optim.clip_by_global_norm(0.0), ValueError, r"max_norm=0\.0"),
        (lambda: optim.scale(True), ValueError, r"step_size=True"),
        (lambda: optim.scale(float("nan")), ValueError, r"finite .* step_size=nan"),
        (lambda: optim.scale(-float("inf")), ValueError, r"finite .* step_size=-inf"),
    ],
)
def test_bad_hyperparameters_are_rejected_eagerly(build, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        build()


def test_numpy_scalar_hyperparameters_are_real_numbers() -> None:
    """A numpy float32 (a config read with numpy) was refused as "must be a finite real
    number" (the check took only int | float, and numpy's float64 subclasses float)."""
    f32 = np.float32
    params = {"w": torch.ones(3)}
    for opt in (
        optim.adamw(f32(0.5), b1=f32(0.5), b2=f32(0.75), eps=f32(0.25), weight_decay=f32(0.5)),
        optim.sgd(f32(0.5), momentum=f32(0.5)),
        optim.lion(f32(0.5), b1=f32(0.5), b2=f32(0.5)),
        optim.chain(optim.clip_by_global_norm(f32(1.0)), optim.sgd(0.5)),
    ):
        updates, _ = opt.update(params, opt.init(params), params)
        assert updates["w"].dtype == torch.float32
    adam, reference = optim.adamw(f32(0.5), b1=f32(0.5)), optim.adamw(0.5, b1=0.5)
    ours = adam.update(params, adam.init(params), params)[0]["w"]
    torch.testing.assert_close(
        ours, reference.update(params, reference.init(params), params)[0]["w"]
    )
    with pytest.raises(ValueError, match=r"b1 is a decay rate .* got b1=np.float32\(1.0\)"):
        optim.adamw(1e-3, b1=f32(1.0))


def test_schedule_returning_a_python_float_is_an_error() -> None:
    opt = optim.sgd(lambda step: 0.1)
    with pytest.raises(TypeError, match=r"must return a 0-d tensor, got 0\.1 at step 0"):
        opt.init({"w": torch.ones(1)})


MODULES = ["_adam", "_aliases", "_clipping", "_inspect", "_lion", "_masking", "_momentum"]
MODULES += ["_scaling", "_schedules", "_transform"]


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module: str) -> None:
    module = importlib.import_module(f"d9d.optim.{module}")
    assert doctest.testmod(module, raise_on_error=True).attempted > 0


def test_a_state_of_another_optimizer_or_other_params_is_named() -> None:
    """Each failed inside the update: sgd's state given to adamw raised "unsupported operand
    type(s) for +: 'builtin_function_or_method' and 'int'" (``tuple.count + 1``), a chain of
    another length "zip() argument 2 is shorter than argument 1", and the state of a params
    tree without one param a broadcast error between two other params' moments (one of the
    same shape would have been used for it silently)."""
    params = {"a": torch.zeros(2), "b": torch.zeros(3)}
    grads = {"a": torch.ones(2), "b": torch.ones(3)}
    adamw = optim.adamw(1e-3)
    with pytest.raises(OptimTreeMismatchError, match=r"scale_by_adam's update got a state of"):
        adamw.update(grads, optim.sgd(1e-3, momentum=0.9).init(params), params)
    clipped = optim.chain(optim.clip_by_global_norm(1.0), adamw)
    with pytest.raises(OptimTreeMismatchError, match=r"chain of 2 transformations got a state"):
        clipped.update(grads, adamw.init(params), params)
    for other in ({"b": torch.zeros(3)}, OrderedDict(b=torch.zeros(3), a=torch.zeros(2))):
        with pytest.raises(
            OptimTreeMismatchError, match=r"the mu state tree .*pass the state opt.init\(params\)"
        ):
            adamw.update(grads, adamw.init(other), params)
