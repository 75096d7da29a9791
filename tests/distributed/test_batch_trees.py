"""Batch trees beyond ``{"tokens", "labels"}`` through every splitter of the batch
(``shard_params(microbatches=k)``, ``step.shard_batch``, ``context_parallel``, ``pipeline``'s
microbatches): what splits equals one device fed the whole batch; what a splitter would cut
wrong (a leaf that hides tensors from the pytree, tensors that disagree on the dim it cuts) is
refused by name."""

from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from typing import NamedTuple

import pytest
import torch
from equivalence import batches, llama

import d9d
from d9d.errors import RankFailedError
from d9d.testing import run_on_ranks

pytestmark = pytest.mark.distributed

F64 = torch.float64


class Targets(NamedTuple):
    labels: torch.Tensor
    weight: torch.Tensor  # [B, S] float loss weights


@dataclasses.dataclass
class Inputs:
    tokens: torch.Tensor
    labels: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    shard: int


def _rich_batch() -> dict:
    """Tokens beside a NamedTuple of labels (-100 on uneven prompts) and float per-token
    weights, a per-example weight [B], and metadata: a string, numbers, None, a dataclass
    without tensors."""
    data = batches(256, steps=1)[0]
    labels = data["labels"].clone()
    for row, prompt in enumerate((3, 12, 16, 10, 0, 16, 5, 1)):
        labels[row, :prompt] = -100
    g = torch.Generator().manual_seed(1)
    return {
        "inputs": {"tokens": data["tokens"]},
        "targets": Targets(labels, torch.rand(labels.shape, generator=g, dtype=F64)),
        "example_weight": torch.rand(8, generator=g, dtype=F64),
        "meta": {"source": Source("web", 3), "name": "shard-3", "step": 7, "lr": 0.5, "x": None},
    }


def _loss_fn(model: d9d.Model):
    def loss_fn(params, batch):
        assert batch["meta"]["source"] == Source("web", 3) and batch["meta"]["x"] is None
        logits = model.apply(params, batch["inputs"]["tokens"])
        labels, weight = batch["targets"]
        per_token = d9d.losses.cross_entropy(logits, labels, reduction="none")
        weighted = per_token * weight * batch["example_weight"][:, None]
        return d9d.losses.token_mean(weighted, labels != -100)

    return loss_fn


BUILD = llama(F64, 2)

LAYOUTS = {
    "2 microbatches": ({"fsdp": 1}, lambda m: d9d.shard_params(m, "fsdp", microbatches=2)),
    "dp=2 (shard_batch)": ({"dp": 2}, lambda m: d9d.shard_params(m, None, "dp")),
    "cp=2": ({"cp": 2}, lambda m: d9d.context_parallel(m)),
    "pp=2, 2 microbatches": ({"pp": 2}, lambda m: d9d.pipeline(m, microbatches=2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_nested_batch_with_weights_and_metadata_equals_one_device(layout: str) -> None:
    model = BUILD()
    loss_fn = _loss_fn(model)
    expected_loss, expected = d9d.value_and_grad(loss_fn)(model.params, _rich_batch())
    mesh_axes, transform = LAYOUTS[layout]

    def rank():
        mesh = d9d.make_mesh("cpu", **mesh_axes)
        own = copy.deepcopy(model)
        own_loss = _loss_fn(own)

        def step(params, opt_state, batch):
            loss, grads = d9d.value_and_grad(own_loss)(params, batch)
            return params, opt_state, {"loss": loss, "grads": grads}

        step = transform(mesh)(step)
        params, state = step.place(own.params, (), model=own)
        metrics = step(params, state, step.shard_batch(_rich_batch()))[2]
        grads = {k: v.full_tensor() for k, v in metrics["grads"].items()}
        return metrics["loss"], grads

    method = "fork" if "pp" in mesh_axes else "thread"  # the threaded group has no p2p ops
    for loss, grads in run_on_ranks(rank, max(mesh_axes.values()), method=method):
        torch.testing.assert_close(loss, expected_loss, rtol=1e-9, atol=0)
        # Under pipeline each rank holds its stages' grads only.
        d9d.testing.assert_trees_all_close(
            grads, {k: expected[k] for k in grads}, rtol=1e-9, atol=1e-12
        )


def _step_of(mesh_axes: dict, transform):
    """A step over a batch that is an ``Inputs`` dataclass, placed on ``mesh_axes``."""
    mesh = d9d.make_mesh("cpu", **mesh_axes)
    model = BUILD()

    def loss_fn(params, batch):
        return d9d.losses.cross_entropy(model.apply(params, batch.tokens), batch.labels)

    def step(params, opt_state, batch):
        loss, _ = d9d.value_and_grad(loss_fn)(params, batch)
        return params, opt_state, {"loss": loss}

    step = transform(mesh)(step)
    return step, *step.place(model.params, (), model=model)


def test_a_dataclass_batch_is_refused_by_microbatches() -> None:
    """Each microbatch ran the whole batch (the splitter took the dataclass as one leaf)."""

    def rank():
        step, params, state = _step_of({"fsdp": 1}, LAYOUTS["2 microbatches"][1])
        step(params, state, Inputs(**batches(256, steps=1)[0]))

    with pytest.raises(
        RankFailedError,
        match=r"TypeError: argument '0' \(Inputs\) is one opaque leaf to d9d's pytrees \(optree\), "
        r"and it holds a tensor \(field 'tokens'\): splitting the batch into 2 microbatches "
        r"would hand it whole to every part; pass its tensors in a dict",
    ):
        run_on_ranks(rank, 1)


def test_a_dataclass_batch_is_refused_by_context_parallel() -> None:
    """Every cp rank took the whole sequence as its slice: loss 5.544031351 for one
    device's 5.544065405 (float64), no error."""

    def rank():
        step, params, state = _step_of({"cp": 2}, LAYOUTS["cp=2"][1])
        step(params, state, Inputs(**batches(256, steps=1)[0]))

    with pytest.raises(
        RankFailedError,
        match=r"TypeError: the batch \(Inputs\) is one opaque leaf .* "
        r"\(field 'tokens'\): splitting the batch into 2 sequence slices would hand it whole",
    ):
        run_on_ranks(rank, 2)


def test_a_mapping_that_is_not_a_dict_is_refused_by_shard_batch() -> None:
    """A ``UserDict`` (as ``transformers``' ``BatchEncoding`` is) went whole to every rank."""

    def rank():
        step, _, _ = _step_of({"dp": 2}, LAYOUTS["dp=2 (shard_batch)"][1])
        step.shard_batch({"encoded": UserDict(batches(256, steps=1)[0])})

    with pytest.raises(
        RankFailedError,
        match=r"TypeError: batch leaf 'encoded' \(UserDict\) is one opaque leaf .* "
        r"\(key 'tokens'\): splitting the batch into 2 data-parallel shards would hand it whole "
        r"to every part; .* "
        r"\(dict\(batch\) for a mapping",
    ):
        run_on_ranks(rank, 2)


def test_a_tensor_shared_by_every_example_is_refused_by_microbatches() -> None:
    """A weight per position ``[S]`` built inside the step and passed to ``value_and_grad``
    beside the batch ``[B, S]``: each microbatch took a piece of it along its own dim 0
    (a shape error inside the loss, naming neither the tensor nor the split)."""

    def rank():
        mesh = d9d.make_mesh("cpu", fsdp=1)

        def loss_fn(params, x, per_position):
            return ((params["w"].to_local() * x) * per_position).mean()

        def step(params, opt_state, batch):
            per_position = torch.linspace(0, 1, batch["x"].shape[1], dtype=F64)
            loss, _ = d9d.value_and_grad(loss_fn)(params, batch["x"], per_position)
            return params, opt_state, {"loss": loss}

        step = d9d.shard_params(mesh, microbatches=2)(step)
        params, state = step.place({"w": torch.ones((), dtype=F64)}, ())
        step(params, state, {"x": torch.ones(8, 4, dtype=F64)})

    with pytest.raises(
        RankFailedError,
        match=r"IndivisibleError: the tensors d9d\.value_and_grad's function is given disagree "
        r"on the batch size \(dim 0\), along which 2 microbatches split every one of them: "
        r"\{'argument 0': 8, 'argument 1': 4\}; .* keep a tensor shared by every example",
    ):
        run_on_ranks(rank, 1)


def test_a_batch_leaf_broadcast_over_examples_is_refused_with_the_fix() -> None:
    """Positions ``[1, S]`` beside tokens ``[B, S]``: microbatches would cut dim 0 of both."""

    def rank():
        step, params, state = _step_of({"fsdp": 1}, LAYOUTS["2 microbatches"][1])
        data = batches(256, steps=1)[0]
        step(params, state, {**data, "position_ids": torch.arange(16)[None]})

    with pytest.raises(
        RankFailedError,
        match=r"IndivisibleError: batch leaves disagree on the batch size \(dim 0\): "
        r"\{'labels': 8, 'position_ids': 1, 'tokens': 8\}; .* expand a tensor shared by every "
        r"example \(a mask or positions \[1, S\]\) to the batch size, or build it in the loss",
    ):
        run_on_ranks(rank, 1)


def test_a_per_example_pair_is_refused_by_context_parallel() -> None:
    """A weight per example and side ``[B, 2]`` (chosen, rejected) beside tokens ``[B, 16]``:
    contiguous cp=2 cut it like a sequence, rank 0 taking the chosen column and rank 1 the
    rejected one, so ``weight[:, 0]`` differed by rank: loss 2.95828 for one device's
    3.31966 (float64), no error."""
    model = BUILD()

    def rank():
        own = copy.deepcopy(model)

        def loss_fn(params, batch):
            logits = own.apply(params, batch["tokens"])
            per_token = d9d.losses.cross_entropy(logits, batch["labels"], reduction="none")
            weighted = per_token * batch["pair_weight"][:, :1]
            return d9d.losses.token_mean(weighted, batch["labels"] != -100)

        def step(params, opt_state, batch):
            loss, _ = d9d.value_and_grad(loss_fn)(params, batch)
            return params, opt_state, {"loss": loss}

        mesh = d9d.make_mesh("cpu", cp=2)
        step = d9d.context_parallel(mesh, load_balance=None)(step)
        params, state = step.place(own.params, (), model=own)
        g = torch.Generator().manual_seed(2)
        pair_weight = torch.rand(8, 2, generator=g, dtype=F64)
        step(params, state, {**batches(256, steps=1)[0], "pair_weight": pair_weight})

    with pytest.raises(
        RankFailedError,
        match=r"IndivisibleError: batch leaves disagree on the sequence length \(dim 1, which "
        r"context_parallel cuts in every batch tensor of rank >= 2\): \{'labels': 16, "
        r"'pair_weight': 2, 'tokens': 16\}; .* pass values per example as tensors of rank 1",
    ):
        run_on_ranks(rank, 2)


@dataclasses.dataclass(frozen=True)
class Stamp:
    step: torch.Tensor  # 0-d: no split cuts it


@pytest.mark.parametrize("layout", ["2 microbatches", "dp=2 (shard_batch)"])
def test_a_model_argument_and_0d_metadata_go_whole_to_every_part(layout: str) -> None:
    """Beside the batch, a ``d9d.Model`` passed to the loss function (a dataclass holding its
    module and params) and a dataclass of 0-d tensors are no data to split: each part takes
    them whole, and the step equals one device (both were refused as hidden batch tensors)."""
    model = BUILD()

    def loss_fn(params, batch, model):
        assert int(batch["stamp"].step) == 7
        return d9d.losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])

    def whole_batch():
        return {**batches(256, steps=1)[0], "stamp": Stamp(torch.tensor(7))}

    expected_loss, expected = d9d.value_and_grad(loss_fn)(model.params, whole_batch(), model)
    mesh_axes, transform = LAYOUTS[layout]

    def rank():
        own = copy.deepcopy(model)

        def step(params, opt_state, batch):
            loss, grads = d9d.value_and_grad(loss_fn)(params, batch, own)
            return params, opt_state, {"loss": loss, "grads": grads}

        step = transform(d9d.make_mesh("cpu", **mesh_axes))(step)
        params, state = step.place(own.params, (), model=own)
        metrics = step(params, state, step.shard_batch(whole_batch()))[2]
        return metrics["loss"], {k: v.full_tensor() for k, v in metrics["grads"].items()}

    for loss, grads in run_on_ranks(rank, max(mesh_axes.values())):
        torch.testing.assert_close(loss, expected_loss, rtol=1e-9, atol=0)
        d9d.testing.assert_trees_all_close(grads, expected, rtol=1e-9, atol=1e-12)
