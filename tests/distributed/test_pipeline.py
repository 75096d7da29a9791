"""``pipeline`` (every schedule, with ``shard_params``, ``tensor_parallel``, tied embeddings and a
Hugging Face model) against the same step on one device; per-rank bytes, P2P traffic, errors.

Ranks are forked gloo processes: the threaded group has no point-to-point ops.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import math
import re
import warnings
from typing import Any

import pytest
import torch
from equivalence import (
    assert_equivalent,
    batches,
    hf_llama,
    llama,
    optimizer,
    reference,
    train_step,
)

import d9d
from d9d.errors import IndivisibleError, PlanError, RankFailedError
from d9d.testing import run_on_ranks
from d9d.transforms.pipeline import PipelineRuntime

pytestmark = pytest.mark.distributed

F32 = {"rtol": 1e-5, "atol": 1e-6}
F64 = torch.float64


def _pp(**options):
    return lambda mesh: [d9d.pipeline(mesh, **options)]


LAYOUTS = {
    "pp=2 gpipe": ({"pp": 2}, 4, _pp(schedule="gpipe", microbatches=4)),
    "pp=2 1f1b": ({"pp": 2}, 4, _pp(schedule="1f1b", microbatches=4)),
    "pp=2 interleaved_1f1b": (
        {"pp": 2},
        4,
        _pp(schedule="interleaved_1f1b", microbatches=4, virtual_stages=2),
    ),
    "pp=2 interleaved_zb": (
        {"pp": 2},
        4,
        _pp(schedule="interleaved_zb", microbatches=4, virtual_stages=2),
    ),
    "pp=2 zbv": ({"pp": 2}, 4, _pp(schedule="zbv", microbatches=4, virtual_stages=2)),
    "pp=2 dualpipev": ({"pp": 2}, 4, _pp(schedule="dualpipev", microbatches=4, virtual_stages=2)),
    "pp=4 1f1b": ({"pp": 4}, 4, _pp(schedule="1f1b", microbatches=4)),
    "pp=4 interleaved_1f1b": (
        {"pp": 4},
        8,
        _pp(schedule="interleaved_1f1b", microbatches=4, virtual_stages=2),
    ),
    "pp=2 x fsdp=2": (
        {"pp": 2, "fsdp": 2},
        4,
        lambda mesh: [d9d.shard_params(mesh), d9d.pipeline(mesh, microbatches=2)],
    ),
    "pp=2 dualpipev x fsdp=2": (
        {"pp": 2, "fsdp": 2},
        4,
        lambda mesh: [
            d9d.shard_params(mesh),
            d9d.pipeline(mesh, schedule="dualpipev", microbatches=4, virtual_stages=2),
        ],
    ),
    "pp=2 x tp=2": (
        {"pp": 2, "tp": 2},
        4,
        lambda mesh: [d9d.pipeline(mesh, microbatches=2), d9d.tensor_parallel(mesh)],
    ),
    "pp=2 x cp=2": (
        {"pp": 2, "cp": 2},
        4,
        lambda mesh: [d9d.context_parallel(mesh), d9d.pipeline(mesh, microbatches=2)],
    ),
    "pp=2 x dp=2": (
        {"pp": 2, "dp": 2},
        4,
        lambda mesh: [
            d9d.pipeline(mesh, microbatches=2),
            d9d.shard_params(mesh, None, replicate_axis="dp"),
        ],
    ),
}


@functools.cache
def _reference(model: str, n_layers: int, dtype: torch.dtype = F64, tie: bool = False):
    build = hf_llama(dtype, n_layers) if model == "hf" else _llama(n_layers, dtype, tie)
    return reference(build, batches(97 if model == "hf" else 256))


def _llama(n_layers: int, dtype: torch.dtype = F64, tie: bool = False):
    return llama(dtype, n_layers, tie_embeddings=True) if tie else llama(dtype, n_layers)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_equals_one_device(name: str) -> None:
    """5 AdamW steps with global-norm clipping, in float64: losses and every param equal one
    device's (rel 1e-9), under every schedule and with FSDP or TP inside the stages."""
    mesh_axes, n_layers, transforms = LAYOUTS[name]
    assert_equivalent(
        _llama(n_layers),
        transforms,
        mesh_axes,
        batches(256),
        _reference("llama", n_layers),
        dtype=F64,
        method="fork",
    )


@pytest.mark.parametrize("name", ["pp=2 1f1b", "pp=2 zbv", "pp=2 x fsdp=2"])
def test_pipeline_float32_losses(name: str) -> None:
    """In float32 the losses match at rel 1e-5 (microbatches reorder the sums, and Adam's
    normalization lifts that rounding in params with tiny grads, so params are compared in
    float64 above)."""
    mesh_axes, n_layers, transforms = LAYOUTS[name]
    assert_equivalent(
        _llama(n_layers, torch.float32),
        transforms,
        mesh_axes,
        batches(256),
        _reference("llama", n_layers, torch.float32),
        dtype=torch.float32,
        tol=F32,
        params_too=False,
        method="fork",
    )


def test_tied_embedding_grads_sum_over_first_and_last_stage() -> None:
    """A head tied to the embedding lives on both end stages; its grads are summed there."""
    assert_equivalent(
        _llama(4, tie=True),
        _pp(microbatches=2),
        {"pp": 2},
        batches(256),
        _reference("llama", 4, tie=True),
        dtype=F64,
        method="fork",
    )


@pytest.mark.parametrize("mesh_axes", [{"pp": 2}, {"pp": 2, "tp": 2}], ids=["pp=2", "pp=2 x tp=2"])
def test_hf_llama_pipeline_equals_one_device(mesh_axes: dict[str, int]) -> None:
    transforms = (
        (lambda mesh: [d9d.pipeline(mesh, microbatches=2), d9d.tensor_parallel(mesh)])
        if "tp" in mesh_axes
        else _pp(microbatches=2)
    )
    assert_equivalent(
        hf_llama(F64, 4),
        transforms,
        mesh_axes,
        batches(97),
        _reference("hf", 4),
        dtype=F64,
        method="fork",
    )


def _stage_bytes_rank(mesh_axes: dict[str, int], microbatches: int, tp: bool):
    mesh = d9d.make_mesh("cpu", **mesh_axes)
    model, opt = llama(torch.float32, 4)(), optimizer()
    step = d9d.pipeline(mesh, microbatches=microbatches)(train_step(model, opt))
    if tp:
        step = d9d.tensor_parallel(mesh)(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    batch = step.shard_batch(batches(256)[0])
    comms = step.comms(params, state, batch)
    layout = next(r for r in step.runtimes if isinstance(r, PipelineRuntime)).layout
    stage_bytes = sum(
        math.prod(t.shape) * t.element_size()
        for p, t in model.params.items()
        if p in layout.split.keys[layout.rank]
    )
    return (
        layout.rank,
        sorted(params),
        sorted(layout.split.keys[layout.rank]),
        step.memory(params, state),
        stage_bytes,
        dict(comms.count),
        dict(comms.bytes),
        step.plan.table(),
    )


def test_each_rank_holds_only_its_stage() -> None:
    """Params and AdamW state on a pp rank are exactly its stage's (two moments each)."""
    results = run_on_ranks(_stage_bytes_rank, 2, {"pp": 2}, 2, False, method="fork")
    model = llama(torch.float32, 4)()
    whole = optimizer().init(model.params)
    param_bytes = sum(t.numel() * t.element_size() for t in model.params.values())
    counters = sum(t.numel() * t.element_size() for t in d9d.tree.leaves(whole)) - 2 * param_bytes
    seen = set()
    for _, held, stage_keys, memory, stage_bytes, _, _, table in results:
        assert held == stage_keys
        assert not seen & set(held)
        seen |= set(held)
        assert memory.params == stage_bytes
        assert memory.opt_state == 2 * stage_bytes + counters  # mu and nu, and step counts
        assert "stage" in table and f"{len(held)} of 39 params held here" in table
    assert seen == set(model.params)
    # Four equal blocks and a head lighter than one block: two blocks per stage.
    first = {"embed.weight"} | {p for p in model.params if p.startswith(("layers.0.", "layers.1."))}
    assert set(results[0][1]) == first
    assert set(results[1][1]) == set(model.params) - first


def test_p2p_traffic_is_one_activation_per_microbatch_and_boundary() -> None:
    """pp=2, 2 microbatches of 4 x 16 tokens, dim 64, float32: rank 0 sends each
    microbatch's activation forward and receives its grad back; rank 1 the reverse. The
    loss and the clipping norm cost one all-reduce each over pp."""
    activation = 4 * 16 * 64 * 4
    for rank, *_, count, nbytes, _ in run_on_ranks(
        _stage_bytes_rank, 2, {"pp": 2}, 2, False, method="fork"
    ):
        assert count[("send", "pp")] == count[("recv", "pp")] == 2
        assert nbytes[("send", "pp")] == nbytes[("recv", "pp")] == 2 * activation
        assert count[("all_reduce", "pp")] == 2
        assert {kind for kind, _ in count} == {"send", "recv", "all_reduce"}, rank


def test_sequence_parallel_stages_pass_sequence_shards() -> None:
    """Under tensor_parallel with sequence parallelism, stages pass S / tp positions."""
    activation = 4 * 16 * 64 * 4 // 2
    for *_, count, nbytes, _ in run_on_ranks(
        _stage_bytes_rank, 4, {"pp": 2, "tp": 2}, 2, True, method="fork"
    ):
        assert nbytes[("send", "pp")] == 2 * activation
        assert count[("send", "pp")] == 2


def _first_and_later_comms(mesh_axes: dict[str, int], make_transforms) -> list[tuple[dict, dict]]:
    mesh = d9d.make_mesh("cpu", **mesh_axes)
    model, opt = llama(torch.float32, 4)(), optimizer()
    step = train_step(model, opt)
    for transform in make_transforms(mesh):
        step = transform(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    batch = step.shard_batch(batches(256)[0])
    first = step.comms(params, state, batch)  # the first step of this batch shape
    later = step.comms(params, state, batch)
    return [(dict(c.count), dict(c.bytes)) for c in (first, later)]


@pytest.mark.parametrize(
    ("mesh_axes", "make_transforms"),
    [
        (
            {"pp": 2, "tp": 2},
            lambda mesh: [d9d.pipeline(mesh, microbatches=2), d9d.tensor_parallel(mesh)],
        ),
        (
            {"pp": 2, "cp": 2, "fsdp": 2},
            lambda mesh: [
                d9d.pipeline(mesh, schedule="zbv", microbatches=2, virtual_stages=2),
                d9d.context_parallel(mesh),
                d9d.shard_params(mesh),
            ],
        ),
    ],
    ids=["pp=2 x tp=2", "pp=2 zbv x cp=2 x fsdp=2"],
)
def test_comms_of_the_first_step_are_those_of_every_step(mesh_axes, make_transforms) -> None:
    """The first step of a batch shape probes the stages' activation shapes with a forward
    of one microbatch, whose collectives inside the stages (tp's gathers, cp's ring, the
    loss's token count) ``step.comms`` counted as the step's: on pp=2 x tp=2, rank 0 counted
    22 tp all-gathers where a step issues 18. Its shape headers were never counted; now
    neither is its forward, so ``step.comms`` (and ``d9d plan``, which runs the same
    executor) is what every step moves."""
    world = math.prod(mesh_axes.values())
    ranks = run_on_ranks(
        _first_and_later_comms, world, mesh_axes, make_transforms, method="fork", timeout=300
    )
    for first, later in ranks:
        assert first == later


def _error_rank(case: str):
    mesh = d9d.make_mesh("cpu", pp=2)
    model, opt = llama(torch.float32, 4 if case == "dualpipev" else 2)(), optimizer()
    options = {
        "stages": {"stages": ["layers.7"]},
        "order": {"stages": ["layers.0"]},
        "too many": {"virtual_stages": 2, "schedule": "interleaved_1f1b"},
        "microbatches": {"microbatches": 3},
        "dualpipev": {"schedule": "dualpipev", "virtual_stages": 2, "microbatches": 2},
        "no model": {},
        "apply outside": {},
        "jit": {},
    }[case]
    step = train_step(model, opt)
    if case == "apply outside":
        step = lambda p, s, b: (p, s, {"logits": model.apply(p, b["tokens"])})  # noqa: E731
    step = d9d.pipeline(mesh, **options)(step)
    if case == "jit":
        step = d9d.jit(step)
    if case == "no model":
        step.place(model.params, opt.init(model.params))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    step(params, state, batches(256)[0])


@pytest.mark.parametrize(
    ("case", "error", "match"),
    [
        ("stages", PlanError, r"split paths \['layers.7'\] are not blocks"),
        ("order", PlanError, "always begins stage 0"),
        ("too many", PlanError, "needs 4 stages but the model has only 2 blocks"),
        ("microbatches", IndivisibleError, "do not split into 3 microbatches"),
        (
            "dualpipev",
            PlanError,
            r"pipeline\(schedule='dualpipev'\) cannot run 2 microbatches on 2 ranks x 2 stages: "
            "DualPipeV requires at least as many microbatches as stages",
        ),
        ("no model", PlanError, r"model=model"),
        (
            "apply outside",  # a forward-only (eval) step: refused, with what to do instead
            PlanError,
            r"only inside d9d.value_and_grad .* A forward-only step \(an eval step, no "
            r"value_and_grad\) has no pipeline schedule in d9d yet: run it under a layout "
            "without pipeline",
        ),
        ("jit", PlanError, "does not compile a pipeline step"),
    ],
)
def test_pipeline_errors(case: str, error: type, match: str) -> None:
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_error_rank, 2, case, method="fork")
    assert error.__name__ in str(info.value)
    assert re.search(match, str(info.value))


def test_schedule_options_are_checked() -> None:
    with pytest.raises(RankFailedError, match="is not a schedule"):
        run_on_ranks(lambda: d9d.pipeline(d9d.make_mesh("cpu", pp=2), schedule="x"), 2)
    with pytest.raises(RankFailedError, match="runs 2 stage"):
        run_on_ranks(lambda: d9d.pipeline(d9d.make_mesh("cpu", pp=2), schedule="zbv"), 2)


def _aux_rank() -> tuple[torch.Tensor, torch.Tensor]:
    mesh = d9d.make_mesh("cpu", pp=2)
    model = llama(F64, 2)()

    def loss_fn(params, batch):
        logits = model.apply(params, batch["tokens"])
        return d9d.losses.cross_entropy(logits, batch["labels"]), {"first": logits[:, 0, 0]}

    def step(params, opt_state, batch):
        (loss, aux), _ = d9d.value_and_grad(loss_fn, has_aux=True)(params, batch)
        return params, opt_state, {"loss": loss, "first": aux["first"]}

    step = d9d.pipeline(mesh, microbatches=2)(step)
    params, state = step.place(model.params, (), model=model)
    _, _, metrics = step(params, state, batches(256)[0])
    return metrics["loss"], metrics["first"]


def test_aux_comes_from_the_last_stage_on_every_rank() -> None:
    model = llama(F64, 2)()
    batch = batches(256)[0]
    logits = model.apply(model.params, batch["tokens"])
    loss = d9d.losses.cross_entropy(logits, batch["labels"])
    for got_loss, first in run_on_ranks(_aux_rank, 2, method="fork"):
        torch.testing.assert_close(got_loss, loss, rtol=1e-12, atol=0)
        torch.testing.assert_close(first, logits[:, 0, 0], rtol=1e-12, atol=0)


def test_docstring_example_runs() -> None:
    module = importlib.import_module("d9d.transforms.pipeline._transform")
    assert doctest.testmod(module, raise_on_error=True).attempted > 0


def _cutting_step() -> tuple[Any, Any, Any, dict[str, torch.Tensor]]:
    """A pp=2 step whose loss cuts the sequences to the batch's ``length`` (a Python int: the
    batch's tensors keep their shapes); its placed params and state, and a batch."""
    mesh = d9d.make_mesh("cpu", pp=2)
    model = llama(F64, 2)()

    def loss_fn(params, batch):
        n = batch["length"]
        logits = model.apply(params, batch["tokens"][:, :n])
        return d9d.losses.cross_entropy(logits, batch["labels"][:, :n])

    @d9d.pipeline(mesh, microbatches=2)
    def step(params, opt_state, batch):
        loss, _ = d9d.value_and_grad(loss_fn)(params, batch)
        return params, opt_state, {"loss": loss}

    params, state = step.place(model.params, (), model=model)
    return step, params, state, batches(256)[0]


def _cut_rank(lengths: tuple[int, ...]) -> list[torch.Tensor]:
    step, params, state, batch = _cutting_step()
    return [step(params, state, {**batch, "length": n})[2]["loss"] for n in lengths]


def test_a_python_int_of_the_batch_that_changes_the_activations_rebuilds_the_stages() -> None:
    """The stages are built for a batch's signature; a Python int in it was keyed by its type
    alone, so a second step cutting the sequences to 8 tokens ran on the stages built for 16:
    rank 1 received an activation of 16 positions and crashed in rope
    (``KernelInputError: rope: cos.shape=(8, 16)``)."""
    model = llama(F64, 2)()
    batch = batches(256)[0]
    expected = [
        d9d.losses.cross_entropy(
            model.apply(model.params, batch["tokens"][:, :n]), batch["labels"][:, :n]
        )
        for n in (16, 8, 16)
    ]
    for losses in run_on_ranks(_cut_rank, 2, (16, 8, 16), method="fork"):
        for got, want in zip(losses, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def _counted_rank() -> list[str]:
    step, params, state, batch = _cutting_step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(10):
            step(params, state, {**batch, "length": 16, "step": n})  # "step": never read
    return [str(w.message) for w in caught if "batch signatures" in str(w.message)]


def test_a_python_int_that_changes_every_step_is_named_once_the_builds_pile_up() -> None:
    """A Python int of the batch is part of the stages' key by value: one that changes every
    step (a step counter) rebuilt the stages every step, with no word."""
    for caught in run_on_ranks(_counted_rank, 2, method="fork"):
        assert len(caught) == 1 and "belongs in it as a 0-d tensor" in caught[0]


def _closed_over_rank() -> None:
    mesh = d9d.make_mesh("cpu", pp=2)
    model = llama(F64, 2)()

    def loss_fn(params, batch, n):
        logits = model.apply(params, batch["tokens"][:, :n])
        return d9d.losses.cross_entropy(logits, batch["labels"][:, :n])

    @d9d.pipeline(mesh, microbatches=2)
    def step(params, opt_state, batch):
        n = int(batch["length"])  # a 0-d tensor, which the batch signature sees by shape
        loss, _ = d9d.value_and_grad(lambda p, b: loss_fn(p, b, n))(params, batch)
        return params, opt_state, {"loss": loss}

    params, state = step.place(model.params, (), model=model)
    for n in (16, 8):
        step(params, state, {**batches(256)[0], "length": torch.tensor(n)})


def test_an_activation_other_than_the_stages_were_built_for_is_refused_by_name() -> None:
    """A value the batch signature does not see (a 0-d tensor, here closed over by the loss
    function) that changes the activations: stage 0 sent 8 positions into rank 1's buffer of
    16, which ran its blocks on it and crashed in rope (a model without rope's check would
    have trained on the buffer's stale tail)."""
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: pipeline stage 0 passes on float64\[4, 8, 64\] for microbatch 0, "
        r"but the stages were built for float64\[4, 16, 64\]",
    ):
        run_on_ranks(_closed_over_rank, 2, method="fork")
