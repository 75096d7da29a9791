"""Random draws in training (dropout, router jitter): refused by name under
``tensor_parallel``; drawn again alike by ``remat``'s recomputation."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from equivalence import batches, train_step

import d9d
from d9d.errors import RankFailedError
from d9d.testing import assert_trees_all_equal, run_on_ranks

pytestmark = pytest.mark.distributed


def _seeded(model_class: type, config: object) -> torch.nn.Module:
    """``model_class(config)`` in float64, initialised from seed 0 (the caller's RNG untouched)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return model_class(config).to(torch.float64)


def _gpt2(dropout: float, n_layers: int = 2) -> torch.nn.Module:
    """A tiny GPT-2 (transformers' default dropouts are 0.1), built once per test."""
    config = transformers.GPT2Config(
        vocab_size=97,
        n_embd=48,
        n_layer=n_layers,
        n_head=6,
        n_positions=64,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        resid_pdrop=dropout,
        bos_token_id=96,
        eos_token_id=96,
    )
    return _seeded(transformers.GPT2LMHeadModel, config)


def _llama(attention_dropout: float) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=100,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        attention_dropout=attention_dropout,
    )
    return _seeded(transformers.LlamaForCausalLM, config)


def _mixtral(router_jitter_noise: float) -> torch.nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=router_jitter_noise,
        experts_implementation="eager",
    )
    return _seeded(transformers.MixtralForCausalLM, config)


def _tp_losses(
    module: torch.nn.Module, change: Callable[[torch.nn.Module], object] | None = None
) -> list[torch.Tensor]:
    """Each rank's loss of a ``tp=2`` step; with ``change``, of a second step after
    ``change(module)`` on the rank's copy of ``module``."""

    def rank() -> torch.Tensor:
        mesh = d9d.make_mesh("cpu", tp=2)
        model = d9d.functionalize(copy.deepcopy(module))
        tp = d9d.tensor_parallel(mesh, sequence_parallel=False)  # GPT-2's blocks stay whole
        step = tp(train_step(model, opt := d9d.optim.sgd(0.1)))
        params, state = step.place(model.params, opt.init(model.params), model=model)
        params, state, metrics = step(params, state, batches(97)[0])
        if change is not None:
            change(model.structure.module)
            metrics = step(params, state, batches(97)[1])[2]
        return metrics["loss"]

    return run_on_ranks(rank, 2)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: _gpt2(0.1),
            r"PlanError: module 'transformer.drop' \(Dropout, p=0.1\) drops out in training "
            r"\(config fields equal to it: attn_pdrop, embd_pdrop, resid_pdrop, "
            r"summary_first_dropout\); tensor_parallel's 'tp' ranks would draw unequal masks",
        ),
        (
            lambda: _llama(0.1),
            r"PlanError: module 'model.layers.0.self_attn' has attention_dropout=0.1, drawn in "
            r"training \(config fields equal to it: attention_dropout\); tensor_parallel's",
        ),
        (
            lambda: _mixtral(0.1),
            r"PlanError: module 'model.layers.0.mlp' has jitter_noise=0.1, drawn in training "
            r"\(config fields equal to it: router_jitter_noise\); tensor_parallel's",
        ),
    ],
    ids=["gpt2 nn.Dropout", "llama attention_dropout", "mixtral router_jitter_noise"],
)
def test_dropout_in_training_is_refused_by_name_under_tensor_parallel(
    build: Any, message: str
) -> None:
    """Ranks seeded per rank drop a replicated activation out differently (GPT-2, tp=2, fork
    ranks: grads 103% off, ``docs/tensor_parallel.md``); ranks seeded alike repeat one mask
    on every shard. Refused before any draw, naming the module and its config fields."""
    with pytest.raises(RankFailedError, match=message):
        _tp_losses(build())


@pytest.mark.parametrize(
    ("build", "change", "message"),
    [
        (
            lambda: _gpt2(0.0, n_layers=1),
            lambda module: setattr(module.transformer.h[0].attn.resid_dropout, "p", 0.1),
            r"module 'transformer.h.0.attn.resid_dropout' \(Dropout, p=0.1\) drops out",
        ),
        (
            lambda: _llama(0.0),
            lambda module: setattr(module.model.layers[0].self_attn, "attention_dropout", 0.1),
            r"module 'model.layers.0.self_attn' has attention_dropout=0.1, drawn in training",
        ),
        (
            lambda: _mixtral(0.1).eval(),
            lambda module: module.train(),
            r"module 'model.layers.0.mlp' has jitter_noise=0.1, drawn in training",
        ),
    ],
    ids=["nn.Dropout p set above 0", "attention_dropout set above 0", "module.train()"],
)
def test_a_draw_turned_on_after_a_step_is_refused_at_the_next(
    build: Any, change: Any, message: str
) -> None:
    """The modules that may draw are found once per model structure, rate 0 included; their
    rates and training flags are read at each ``Model.apply``, so a rate set above 0 or
    ``module.train()`` between two steps is refused at the second."""
    with pytest.raises(RankFailedError, match=message):
        _tp_losses(build(), change)


def test_a_model_with_dropout_in_eval_mode_steps_under_tensor_parallel() -> None:
    """``module.eval()`` turns dropout off: not refused, and equal to one device."""
    module = _gpt2(0.1).eval()
    model = d9d.functionalize(copy.deepcopy(module))
    step = train_step(model, opt := d9d.optim.sgd(0.1))
    expected = step(model.params, opt.init(model.params), batches(97)[0])[2]["loss"]
    for loss in _tp_losses(module):
        torch.testing.assert_close(loss, expected, rtol=1e-9, atol=1e-12)


REMAT_LAYOUTS = {
    "one device": ({"dp": 1}, lambda mesh: [d9d.shard_params(mesh, "dp")]),
    # zero bubble: each block recomputed twice (input grads, then weight grads)
    "pp=2 zbv": (
        {"pp": 2},
        lambda mesh: [d9d.pipeline(mesh, schedule="zbv", microbatches=2, virtual_stages=2)],
    ),
}


@pytest.mark.parametrize("layout", list(REMAT_LAYOUTS))
def test_remat_draws_the_masks_of_the_first_forward_again(layout: str) -> None:
    """GPT-2 with dropout 0.1 in its embedding, attention and residual: grads with every block
    recomputed are bitwise those without remat, from the same seed (torch's checkpoint
    restores the generator before each recomputation). Process ranks: each draws from its
    own generator."""
    axes, make = REMAT_LAYOUTS[layout]
    module = _gpt2(0.1, n_layers=4)

    def rank(remat: bool, seed: int) -> dict[str, torch.Tensor]:
        mesh = d9d.make_mesh("cpu", **axes)
        model = d9d.functionalize(copy.deepcopy(module))

        def loss_fn(params: Any, batch: dict) -> torch.Tensor:
            logits = model.apply(params, batch["tokens"]).logits
            return d9d.losses.cross_entropy(logits, batch["labels"])

        def step(params: Any, opt_state: Any, batch: dict) -> tuple[Any, Any, Any]:
            loss, grads = d9d.value_and_grad(loss_fn)(params, batch)
            return grads, opt_state, {"loss": loss}

        transforms = make(mesh)
        if remat:
            transforms.append(d9d.remat("full", mesh=mesh))
        for transform in transforms:
            step = transform(step)
        params, state = step.place(model.params, (), model=model)
        torch.manual_seed(seed)
        grads, _, metrics = step(params, state, batches(97)[0])
        return {**{p: g.full_tensor() for p, g in grads.items()}, "loss": metrics["loss"]}

    world = math.prod(axes.values())
    plain = run_on_ranks(rank, world, False, 1, method="fork")
    recomputed = run_on_ranks(rank, world, True, 1, method="fork")
    for got, expected in zip(recomputed, plain, strict=True):
        assert_trees_all_equal(got, expected)
    other_seed = run_on_ranks(rank, world, False, 2, method="fork")  # the masks do count
    assert not torch.equal(other_seed[0]["loss"], plain[0]["loss"])
