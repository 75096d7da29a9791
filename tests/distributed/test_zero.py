"""``shard_params(shard="grads" | "opt_state")``: ZeRO-2 and ZeRO-1 against one device, and
their memory and communication per rank, exactly."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from equivalence import (
    assert_equivalent,
    batches,
    hf_llama,
    hf_model,
    llama,
    optimizer,
    reference,
    train_step,
)
from graph_collectives import assert_bitwise_in_one_graph, eager_and_jitted
from torch.distributed.tensor import Replicate, Shard

import d9d
from d9d.errors import PlanError
from d9d.testing import assert_trees_all_close, run_on_ranks
from d9d.transforms.shard_params import ZeroStage

pytestmark = pytest.mark.distributed

ZERO = {"zero1": "opt_state", "zero2": "grads"}

LAYOUTS = {
    "fsdp=2": ({"fsdp": 2}, lambda mesh, shard: [d9d.shard_params(mesh, "fsdp", shard=shard)]),
    "dp=2 x fsdp=2": (
        {"dp": 2, "fsdp": 2},
        lambda mesh, shard: [d9d.shard_params(mesh, "fsdp", "dp", shard=shard)],
    ),
    "fsdp=2 x tp=2": (
        {"fsdp": 2, "tp": 2},
        lambda mesh, shard: [
            d9d.shard_params(mesh, "fsdp", shard=shard),
            d9d.tensor_parallel(mesh),
        ],
    ),
    "fsdp=2, 2 microbatches": (
        {"fsdp": 2},
        lambda mesh, shard: [d9d.shard_params(mesh, "fsdp", shard=shard, microbatches=2)],
    ),
}


@functools.cache
def _reference(opt: str = "adamw"):
    return reference(llama(torch.float64), batches(256), opt=opt)


@pytest.mark.parametrize("zero", list(ZERO))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_equals_one_device(zero: str, layout: str) -> None:
    """5 AdamW steps after global-norm clipping (``equivalence.optimizer``), float64."""
    mesh_axes, transforms = LAYOUTS[layout]
    assert_equivalent(
        llama(torch.float64),
        lambda mesh: transforms(mesh, ZERO[zero]),
        mesh_axes,
        batches(256),
        _reference(),
        dtype=torch.float64,
    )


@pytest.mark.parametrize("zero", list(ZERO))
def test_uneven_shards_equal_one_device(zero: str) -> None:
    """A Hugging Face Llama of vocab 97: its embedding and head split 49 + 48 rows (padded
    in the reduce-scatter and in the all-gather of the updates)."""
    build = hf_llama(torch.float64)
    assert_equivalent(
        build,
        lambda mesh: LAYOUTS["fsdp=2"][1](mesh, ZERO[zero]),
        {"fsdp": 2},
        batches(97),
        _hf_reference(),
        dtype=torch.float64,
    )


@functools.cache
def _hf_reference():
    return reference(hf_llama(torch.float64), batches(97))


@pytest.mark.parametrize("zero", list(ZERO))
def test_params_tensor_parallel_shards_whole_equal_one_device(zero: str) -> None:
    """Qwen2 under fsdp=2 x tp=2: its q/k/v biases have one dim, which tensor_parallel
    shards, so their state is sharded over fsdp within tp's shards (nested, as DTensor lays
    ``(Shard(0), Shard(0))`` out: fsdp first). Their grads cannot join a block's
    reduce-scatter of tp-local rows; two steps."""
    build, data = hf_model("qwen2-pad0", torch.float64), batches(97, steps=2)
    assert_equivalent(
        build,
        lambda mesh: LAYOUTS["fsdp=2 x tp=2"][1](mesh, ZERO[zero]),
        {"fsdp": 2, "tp": 2},
        data,
        reference(build, data),
        dtype=torch.float64,
    )


def _grads_rank(mesh_axes: dict[str, int], shard: str, microbatches: int, batch: dict):
    mesh = d9d.make_mesh("cpu", **mesh_axes)
    model = llama(torch.float64)()
    seen = {}

    def step(params, opt_state, batch):
        loss_fn = d9d.value_and_grad(
            lambda p, b: d9d.losses.cross_entropy(model.apply(p, b["tokens"]), b["labels"])
        )
        _, grads = loss_fn(params, batch)
        seen.update(grads)
        return params, opt_state, {}

    axis = "dp" if "dp" in mesh_axes else None
    step = d9d.shard_params(mesh, "fsdp", axis, shard=shard, microbatches=microbatches)(step)
    params, state = step.place(model.params, ())
    step(params, state, step.shard_batch(batch))
    return {k: (tuple(g.placements), g.full_tensor()) for k, g in seen.items()}


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("zero", list(ZERO))
def test_grads_equal_one_device(zero: str, microbatches: int) -> None:
    """The grads the step body sees: shards of the one-device grads (the mean over the data
    ranks), on dp=2 x fsdp=2. Clipping makes the equivalence above blind to a grad's
    scale (a sum instead of a mean over ranks); this is not."""
    model, batch = llama(torch.float64)(), batches(256)[0]
    expected = d9d.grad(
        lambda p: d9d.losses.cross_entropy(model.apply(p, batch["tokens"]), batch["labels"])
    )(model.params)
    mesh_axes = {"dp": 2, "fsdp": 2}
    for grads in run_on_ranks(_grads_rank, 4, mesh_axes, ZERO[zero], microbatches, batch):
        for path, (placements, grad) in grads.items():
            assert placements == (Replicate(), Shard(0)), path
            torch.testing.assert_close(grad, expected[path], rtol=1e-9, atol=1e-12)


def _placed(shard: str, **options):
    mesh = d9d.make_mesh("cpu", fsdp=2)
    model, opt = llama()(), optimizer()
    step = d9d.shard_params(mesh, shard=shard, **options)(train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params))
    return step, params, state


def _memory_and_comms(shard: str):
    step, params, state = _placed(shard)
    memory = step.memory(params, state)
    stats = step.comms(params, state, step.shard_batch(batches(256)[0]))
    table = str(step.plan).splitlines()
    row = next(line for line in table if "layers.0.attn.wq.weight" in line)
    header = next(line for line in table if "path" in line)
    column = ("zero" in header, "ZeRO-" in row)
    leaves = d9d.tree.leaves(state)
    counters = sum(x.numel() * x.element_size() for x in leaves if x.ndim == 0)
    shapes = {
        "params": sorted(tuple(v.to_local().shape) for v in params.values()),
        "state": sorted(tuple(x.to_local().shape) for x in leaves if x.ndim),
    }
    return memory, counters, dict(stats.count), dict(stats.bytes), shapes, column, row


def test_memory_and_communication_per_rank_are_exact() -> None:
    """Tiny Llama (float32, every dim 0 even): Ψ params of 4 bytes, AdamW's two moments.
    Per rank: ZeRO-3 all three sharded; ZeRO-2 and ZeRO-1 params whole, the grads the update
    sees sharded (ZeRO-1 slices its all-reduced grads, test_zero_held_bytes.py); the moments
    always sharded. ZeRO-2 reduce-scatters the grads of each block in one
    collective, as ZeRO-3 does, and all-gathers the updated params in one; ZeRO-1 all-reduces
    the grads instead."""
    model = llama()()
    psi = sum(p.numel() for p in model.params.values())
    whole, half = 4 * psi, 4 * psi // 2
    whole_shapes = sorted(tuple(p.shape) for p in model.params.values())
    half_shapes = sorted((p.shape[0] // 2, *p.shape[1:]) for p in model.params.values())
    results = {s: run_on_ranks(_memory_and_comms, 2, s) for s in ("params", "grads", "opt_state")}
    expected = {"params": (half, half), "grads": (whole, half), "opt_state": (whole, half)}
    for shard, ranks in results.items():
        for memory, counters, count, nbytes, shapes, column, row in ranks:
            assert column == (shard != "params",) * 2  # the plan's zero column
            if shard != "params":
                assert f"ZeRO-{1 if shard == 'opt_state' else 2}" in row
            assert (memory.params, memory.grads) == expected[shard]
            assert memory.opt_state == 2 * half + counters
            assert shapes["params"] == (half_shapes if shard == "params" else whole_shapes)
            assert shapes["state"] == sorted(2 * half_shapes)
            if shard == "params":
                continue
            assert count[("all_gather", "fsdp")] == 1
            assert nbytes[("all_gather", "fsdp")] == whole
    zero3, zero2, zero1 = (results[s][0] for s in ("params", "grads", "opt_state"))
    units = 1 + 2  # the params outside blocks, then each block: one reduction each
    assert zero2[2][("reduce_scatter", "fsdp")] == zero3[2][("reduce_scatter", "fsdp")] == units
    assert zero2[3][("reduce_scatter", "fsdp")] == zero3[3][("reduce_scatter", "fsdp")] == whole
    assert ("reduce_scatter", "fsdp") not in zero1[2]
    # the rest of the all-reduces (the loss's token count, the clipping norm) are alike
    assert zero1[2][("all_reduce", "fsdp")] == zero2[2][("all_reduce", "fsdp")] + units
    assert zero1[3][("all_reduce", "fsdp")] == zero2[3][("all_reduce", "fsdp")] + whole


def _mixed_rank(shard: str):
    step, params, state = _placed(shard, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    stats = step.comms(params, state, step.shard_batch(batches(256)[0]))
    losses = []
    for batch in batches(256):
        params, state, metrics = step(params, state, step.shard_batch(batch))
        losses.append(metrics["loss"])
    return dict(stats.count), torch.stack(losses), {p.dtype for p in params.values()}


def test_mixed_precision_computes_in_bf16_with_fp32_params() -> None:
    """Blocks compute in bf16 from the whole fp32 params (no all-gather in the forward),
    grads are reduced in fp32, and the losses are ZeRO-3's in the same precision."""
    zero3 = run_on_ranks(_mixed_rank, 2, "params")[0]
    for shard in ZERO.values():
        count, losses, dtypes = run_on_ranks(_mixed_rank, 2, shard)[0]
        assert dtypes == {torch.float32}
        assert count[("all_gather", "fsdp")] == 1  # the updated params, once
        torch.testing.assert_close(losses, zero3[1], rtol=1e-5, atol=0)


def test_bad_shard_and_missing_axis_are_refused() -> None:
    mesh = d9d.make_mesh("cpu", fsdp=1)
    with pytest.raises(PlanError, match=r"shard='zero2'.*'grads' \(ZeRO-2"):
        d9d.shard_params(mesh, shard="zero2")
    with pytest.raises(PlanError, match=r"shard='opt_state'\) shards over axis=, but axis=None"):
        d9d.shard_params(mesh, None, replicate_axis="fsdp", shard="opt_state")


@pytest.mark.parametrize("option", ["reshard_after_forward", "prefetch"])
def test_zero3_only_options_are_refused(option: str) -> None:
    mesh = d9d.make_mesh("cpu", fsdp=1)
    for shard in ZERO.values():
        with pytest.raises(
            PlanError,
            match=rf"shard='{shard}'\) got {option}=False: .* drop {option}= or use shard='params'",
        ):
            d9d.shard_params(mesh, shard=shard, **{option: False})


def test_zero_stage_is_1_or_2() -> None:
    assert ZeroStage(2).cell() == "ZeRO-2"
    with pytest.raises(ValueError, match=r"ZeroStage\(stage=3\).*pass stage=1 or 2"):
        ZeroStage(3)


def _bad_return_rank():
    step, params, state = _placed("grads")
    batch = step.shard_batch(batches(256)[0])
    path = "layers.0.attn.wq.weight"
    missing = step.sharing_plan(lambda p, s, b: ({k: v for k, v in p.items() if k != path}, s, {}))
    with pytest.raises(PlanError, match=rf"returned no param '{path}'.*\(Shard\(dim=0\)\)"):
        missing(params, state, batch)
    plain = step.sharing_plan(lambda p, s, b: ({**p, path: p[path].to_local()}, s, {}))
    with pytest.raises(
        PlanError, match=rf"returned param '{path}' as a Tensor.*\(Shard\(dim=0\)\)"
    ):
        plain(params, state, batch)


def test_body_returning_a_missing_or_plain_param_is_refused() -> None:
    run_on_ranks(_bad_return_rank, 2)


# ZeRO-3 (reshard_after_forward, the default) under jit: its graph pass gathers again for the
# backward, per microbatch, as the eager saved-tensor hooks do.
JIT_ZERO = {
    **{zero: (shard, 1) for zero, shard in ZERO.items()},
    "zero3, 2 microbatches": ("params", 2),
}

# All-gathers of one step over fsdp, 1 layer: ZeRO-1/2 gather the updated params once; ZeRO-3
# gathers the root params and the block in each microbatch's forward, and again in its backward
# (the root params but for the embedding table, which the backward does not read).
JIT_GATHERS = {"zero1": 1, "zero2": 1, "zero3, 2 microbatches": 2 * (2 + 2)}


def _jit_rank(shard: str, microbatches: int):
    """3 AdamW steps (clipping) eager and under ``d9d.jit(backend="aot_eager")``, float32 on
    fsdp=2: losses, params, the traces, the eager step's collectives (``step.comms``) and
    those of the graphs the compiled step runs (``eager_and_jitted``)."""

    def build():
        mesh = d9d.make_mesh("cpu", fsdp=2)
        model, opt = llama(torch.float32, 1)(), optimizer()
        sharded = d9d.shard_params(mesh, shard=shard, microbatches=microbatches)
        return mesh, sharded(train_step(model, opt)), model, opt

    return eager_and_jitted(build, batches(256, steps=3), backend="aot_eager")


@pytest.mark.compile
@pytest.mark.parametrize("zero", list(JIT_ZERO))
def test_jit_equals_eager_bit_for_bit_and_moves_the_same_collectives(zero: str) -> None:
    """The whole step in one graph traced once, equal to the eager step bit for bit over 3
    steps, with its collectives, count and bytes. ZeRO-1/2: params whole, grads reduced per
    block, the update on the slices, the new params all-gathered in one collective. ZeRO-3:
    each gathered param the backward reads is gathered again there, not kept from the
    forward (``reshard_after_forward``, as eager)."""
    for eager, jitted in run_on_ranks(_jit_rank, 2, *JIT_ZERO[zero], timeout=300):
        assert_bitwise_in_one_graph(eager, jitted)
        assert jitted[3].count[("all_gather", "fsdp")] == JIT_GATHERS[zero]


@pytest.mark.compile
@pytest.mark.usefixtures("math_attention")
def test_jit_inductor_equals_one_device() -> None:
    """ZeRO-1 compiled by inductor (its grads all-reduced, then sliced in the graph): one
    block, float64, 5 AdamW steps with clipping, equal to one device; the harness asserts
    one trace for all steps."""
    build, data = llama(torch.float64, 1), batches(256)
    assert_equivalent(
        build,
        lambda mesh: LAYOUTS["fsdp=2"][1](mesh, "opt_state"),
        {"fsdp": 2},
        data,
        reference(build, data),
        dtype=torch.float64,
        jit=True,
    )


def _unchanged_rank():
    step, params, state = _placed("grads")
    evaluate = step.sharing_plan(lambda p, s, b: (p, s, {}))
    stats = evaluate.comms(params, state, step.shard_batch(batches(256)[0]))
    after, _, _ = evaluate(params, state, step.shard_batch(batches(256)[0]))
    return dict(stats.count), all(after[k] is params[k] for k in params)


def test_params_returned_unchanged_are_not_gathered() -> None:
    """A step that returns the slices it was given (an eval step) returns the stored
    params themselves, with no all-gather."""
    for count, same in run_on_ranks(_unchanged_rank, 2):
        assert count == {} and same


def _kept_rank(shard: str):
    step, params, state = _placed(shard)
    before = {k: v.to_local().clone() for k, v in params.items()}
    new, _, _ = step(params, state, step.shard_batch(batches(256)[0]))
    return (
        all(torch.equal(params[k].to_local(), before[k]) for k in params),
        any(not torch.equal(new[k].to_local(), before[k]) for k in params),
    )


@pytest.mark.parametrize("zero", list(ZERO))
def test_the_callers_params_are_left_as_they_were(zero: str) -> None:
    """The body's slices are views of the stored params, and the update writes new slices:
    after an eager step the params passed in hold what they held (params in, params out),
    and the params returned differ."""
    for kept, updated in run_on_ranks(_kept_rank, 2, ZERO[zero]):
        assert kept and updated


def _spawned_rank(data: list[dict]):
    mesh = d9d.make_mesh("cpu", fsdp=2)
    model, opt = llama(torch.float64)(), optimizer()
    step = d9d.shard_params(mesh, shard="grads")(train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params))
    for batch in data:
        params, state, _ = step(params, state, step.shard_batch(batch))
    return hash("layers.0.attn.wq.weight"), {k: v.full_tensor() for k, v in params.items()}


def test_processes_with_their_own_string_hashes_agree() -> None:
    """Spawned ranks draw their own string hash seeds (unless PYTHONHASHSEED is set): the
    order of the coalesced collectives' buffers must not follow a set's order."""
    data = batches(256, steps=2)
    expected = reference(llama(torch.float64), data)[1]
    ranks = run_on_ranks(_spawned_rank, 2, data, method="spawn", timeout=600)
    if "PYTHONHASHSEED" not in os.environ:
        assert ranks[0][0] != ranks[1][0]  # the ranks did hash strings differently
    for _, params in ranks:
        assert_trees_all_close(params, expected, rtol=1e-9, atol=1e-12)


def _checkpoint_rank(path: str):
    data = batches(256, steps=2)
    trained = {}
    for shard in ("params", "grads"):  # saved under ZeRO-3, restored under ZeRO-2
        mesh = d9d.make_mesh("cpu", fsdp=2)
        model, opt = llama(torch.float64)(), optimizer()
        step = d9d.shard_params(mesh, shard=shard)(train_step(model, opt))
        params, state = step.place(model.params, opt.init(model.params))
        if shard == "params":
            params, state, _ = step(params, state, step.shard_batch(data[0]))
            saved = d9d.checkpoint.save(path, {"params": params, "state": state}, step=1).wait()
        else:
            restored = d9d.checkpoint.restore(saved, {"params": params, "state": state})
            params, state = restored["params"], restored["state"]
        params, state, _ = step(params, state, step.shard_batch(data[1]))
        trained[shard] = {k: v.full_tensor() for k, v in params.items()}
    return trained


def test_checkpoint_of_zero3_resumes_under_zero2(tmp_path) -> None:
    """The checkpoint restores into ZeRO-2's layout (params whole, state sharded), and the
    next step equals the one ZeRO-3 takes."""
    for trained in run_on_ranks(_checkpoint_rank, 2, str(tmp_path / "ckpt")):
        assert_trees_all_close(trained["grads"], trained["params"], rtol=1e-9, atol=1e-12)


def _hsdp_rank(shard: str):
    mesh = d9d.make_mesh("cpu", dp=2, fsdp=2)
    model, opt = llama()(), optimizer()
    step = d9d.shard_params(mesh, "fsdp", "dp", shard=shard)(train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params))
    stats = step.comms(params, state, step.shard_batch(batches(256)[0]))
    return dict(stats.count), dict(stats.bytes)


def test_hsdp_reduces_each_block_over_dp_in_one_all_reduce() -> None:
    """dp=2 x fsdp=2: ZeRO-2 reduce-scatters a block's grads over fsdp and all-reduces the
    shards over dp in one collective each, as ZeRO-3 does (the same counts and bytes); its
    updated params are all-gathered once over fsdp."""
    (zero3_count, zero3_bytes), *_ = run_on_ranks(_hsdp_rank, 4, "params")
    (count, nbytes), *_ = run_on_ranks(_hsdp_rank, 4, "grads")
    for key in (("reduce_scatter", "fsdp"), ("all_reduce", "dp")):
        assert (count[key], nbytes[key]) == (zero3_count[key], zero3_bytes[key]), key
    assert count[("reduce_scatter", "fsdp")] == 1 + 2
    assert count[("all_gather", "fsdp")] == 1
    assert ("all_gather", "dp") not in count


SHARDS = {"zero1": "opt_state", "zero2": "grads", "zero3": "params"}


def _halves() -> list[dict]:
    return batches(256, global_batch=4, steps=3)


def _master_run(shard: str | None):
    """bfloat16 params under ``master_weights(adamw)`` for 3 steps: on fsdp=2 (``shard``) fed
    each half batch twice, so that each rank computes what one device (None) computes on
    the half, and the mean of the two ranks' grads is exact."""
    model = llama(torch.bfloat16)()
    opt = d9d.optim.master_weights(d9d.optim.adamw(1e-2, weight_decay=0.1))
    step = train_step(model, opt)
    if shard is not None:
        step = d9d.shard_params(d9d.make_mesh("cpu", fsdp=2), shard=shard)(step)
        params, state = step.place(model.params, opt.init(model.params))
    else:
        params, state = model.params, opt.init(model.params)
    losses = []
    for half in _halves():
        batch = {k: torch.cat([v, v]) for k, v in half.items()} if shard else half
        params, state, metrics = step(params, state, step.shard_batch(batch) if shard else batch)
        losses.append(metrics["loss"])
    if shard is not None:
        params = {k: v.full_tensor() for k, v in params.items()}
        state = d9d.tree.map(lambda x: x.full_tensor() if x.ndim else x, state)
    return torch.stack(losses), params, state.master


@functools.cache
def _master_reference():
    return _master_run(None)


@pytest.mark.parametrize("zero", list(SHARDS))
def test_master_weights_shard_with_the_state_and_equal_one_device_bitwise(zero: str) -> None:
    """bfloat16 params with float32 masters (``master_weights``), which are optimizer state
    and so sharded as the moments are: losses, params and masters bit for bit one device's
    over 3 AdamW steps."""
    losses, params, masters = _master_reference()
    for rank in run_on_ranks(_master_run, 2, SHARDS[zero]):
        assert torch.equal(rank[0], losses)
        for path in params:
            assert torch.equal(rank[1][path], params[path]), path
            assert torch.equal(rank[2][path], masters[path]), path
        assert {p.dtype for p in rank[1].values()} == {torch.bfloat16}


def _master_memory(shard: str):
    mesh = d9d.make_mesh("cpu", fsdp=2)
    model = llama(torch.bfloat16)()
    opt = d9d.optim.master_weights(optimizer())
    step = d9d.shard_params(mesh, shard=shard)(train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params))
    memory = step.memory(params, state)
    counters = sum(x.numel() * x.element_size() for x in d9d.tree.leaves(state) if x.ndim == 0)
    masters = {tuple(m.placements) for m in state.master.values()}
    return memory, counters, masters


def test_master_weights_memory_per_rank_is_the_mixed_precision_adam_of_zero() -> None:
    """bfloat16 params with float32 masters and AdamW moments, fsdp=2: per rank 2Ψ of
    params when whole, 2Ψ/N of grads (ZeRO-1 keeps the slices of its all-reduced grads),
    and 12Ψ/N of state (Rajbhandari et al.: ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N; their ZeRO-1,
    4Ψ + 12Ψ/N, keeps its grads whole), each master sharded as its param's moments."""
    psi = sum(p.numel() for p in llama()().params.values())
    whole, half = 2 * psi, psi
    expected = {"opt_state": (whole, half), "grads": (whole, half), "params": (half, half)}
    for shard, (params, grads) in expected.items():
        for memory, counters, masters in run_on_ranks(_master_memory, 2, shard):
            assert (memory.params, memory.grads) == (params, grads), shard
            assert memory.opt_state == 12 * psi // 2 + counters, shard
            assert masters == {(Shard(0),)}, shard
