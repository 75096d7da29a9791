"""``fp8(gather_in_fp8=True)``: weights all-gathered as e4m3 data + a scale from the whole
weight's amax (``d9d/transforms/fp8/_gather.py``).

The fp8 gather changes only what crosses the wire: the data and scale equal those the fp8
linear takes of the weight gathered in its compute dtype, so the step is bitwise the fp8
step without it (losses and params over several AdamW steps, fsdp=2 and fsdp=2 x tp=2,
float32 and bfloat16 gathers). Against one device the fp8 step is within fp8 noise under
fsdp (each rank scales its own batch's activations: ``test_fp8.py``); the test here asserts
the same 17 dB bound of the fp8 gather's grads. Bytes are counted against their formula.
"""

from __future__ import annotations

import math

import pytest
import torch
from equivalence import batches, llama, optimizer, run, train_step
from graph_collectives import assert_bitwise_in_one_graph, eager_and_jitted

import d9d
from d9d.errors import PlanError
from d9d.testing import run_on_ranks

pytestmark = pytest.mark.distributed

DATA = batches(256, global_batch=4, seq_len=16, steps=3)


def _fp8_step(
    gather: bool,
    param_dtype: torch.dtype | None = None,
    microbatches: int = 1,
    schedule: str = "1f1b",
):
    def transforms(mesh):
        layout = [d9d.tensor_parallel(mesh)] if "tp" in mesh.mesh_dim_names else []
        if "pp" in mesh.mesh_dim_names:
            stages = 2 if schedule == "zbv" else 1
            layout.append(
                d9d.pipeline(mesh, microbatches=2, schedule=schedule, virtual_stages=stages)
            )
        storage = d9d.shard_params(mesh, param_dtype=param_dtype, microbatches=microbatches)
        return [*layout, storage, d9d.fp8(mesh, "tensorwise", gather_in_fp8=gather)]

    return transforms


@pytest.mark.parametrize(
    ("axes", "param_dtype", "microbatches", "method"),
    [
        ({"fsdp": 2}, None, 1, "thread"),
        # Processes on gloo, which all-gathers no fp8 dtype: the codec sends the bits as uint8.
        ({"fsdp": 2}, torch.bfloat16, 1, "fork"),
        ({"fsdp": 2}, None, 2, "thread"),  # grads accumulated unreduced, reduced once
        ({"fsdp": 2, "tp": 2}, None, 1, "thread"),
    ],
)
def test_fp8_gather_bitwise_the_fp8_step_without_it(axes, param_dtype, microbatches, method):
    want = run(llama(), _fp8_step(False, param_dtype, microbatches), axes, DATA, method=method)
    got = run(llama(), _fp8_step(True, param_dtype, microbatches), axes, DATA, method=method)
    for (losses, params), (want_losses, want_params) in zip(got, want, strict=True):
        assert torch.equal(losses, want_losses), (losses, want_losses)
        for path, value in params.items():
            assert torch.equal(value, want_params[path]), path


@pytest.mark.parametrize(("schedule", "layers"), [("1f1b", 2), ("zbv", 4)])
def test_fp8_gather_under_pipeline_bitwise_the_fp8_step_without_it(schedule, layers):
    """A stage gathers its params once per step, its fp8 weights as e4m3 data and scale,
    which serve every microbatch (pp=2 x fsdp=2, 2 microbatches; zbv: two stages a rank)."""
    axes = {"pp": 2, "fsdp": 2}
    model = llama(n_layers=layers)
    want = run(model, _fp8_step(False, schedule=schedule), axes, DATA, method="fork")
    got = run(model, _fp8_step(True, schedule=schedule), axes, DATA, method="fork")
    for (losses, params), (want_losses, want_params) in zip(got, want, strict=True):
        assert torch.equal(losses, want_losses), (losses, want_losses)
        for path, value in params.items():
            assert torch.equal(value, want_params[path]), path


def _grads(axes: dict[str, int], batch: dict) -> dict[str, torch.Tensor]:
    mesh = d9d.make_mesh("cpu", **axes)
    model = llama()()

    def loss_fn(params, batch):
        return d9d.losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])

    step = lambda p, s, b: (d9d.grad(loss_fn)(p, b), s, {})  # noqa: E731
    gather = axes != {"fsdp": 1}
    for transform in _fp8_step(gather)(mesh):
        step = transform(step)
    params, _ = step.place(model.params, (), model=model)
    grads = step(params, (), step.shard_batch(batch))[0]
    return {k: v.full_tensor() for k, v in grads.items()}


def _sqnr(want: torch.Tensor, got: torch.Tensor) -> float:
    noise = (want - got).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(want.pow(2).sum().item() / noise)


@pytest.mark.parametrize("axes", [{"fsdp": 2}, {"fsdp": 2, "tp": 2}])
def test_fp8_gather_grads_near_one_device_fp8(axes):
    """One step's grads within 17 dB of signal to noise of the one-device fp8 step's (the
    bound fp8 holds against float32; the noise is the ranks' own activation scales)."""
    batch = DATA[0]
    (want,) = run_on_ranks(_grads, 1, {"fsdp": 1}, batch)
    for got in run_on_ranks(_grads, math.prod(axes.values()), axes, batch):
        worst = min(_sqnr(want[p], got[p]) for p in got)
        assert worst >= 17, f"{worst:.1f} dB"


def _comms(gather: bool, param_dtype: torch.dtype | None, microbatches: int = 1, pp: int = 1):
    mesh = d9d.make_mesh("cpu", pp=pp, fsdp=2) if pp > 1 else d9d.make_mesh("cpu", fsdp=2)
    model = llama()()
    step = lambda p, s, b: (d9d.grad(lambda q, c: model.apply(q, c).float().mean())(p, b), s, {})  # noqa: E731
    for transform in _fp8_step(gather, param_dtype, microbatches)(mesh):
        step = transform(step)
    params, _ = step.place(model.params, (), model=model)
    fp8 = [p for p in step.plan.held if type(step.plan[p].codec).__name__ == "Fp8Gather"]
    stats = step.comms(params, (), step.shard_batch(DATA[0])["tokens"])
    memory = step.memory(params, ())
    return stats, memory, fp8, {p: math.prod(e.shape) for p, e in step.plan.entries.items()}


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_fp8_gather_bytes_counted(param_dtype):
    """Each fp8 weight moves 1 byte per element instead of its compute dtype's, plus one
    float32 amax per weight, all in one all-reduce per step; grads are reduce-scattered in
    the param's dtype as before, and per-rank memory is unchanged."""

    def both(param_dtype):
        return _comms(False, param_dtype), _comms(True, param_dtype)

    ranks = run_on_ranks(both, 2, param_dtype)
    (plain, plain_memory, _, _), (fp8, fp8_memory, paths, numel) = ranks[0]
    width = (param_dtype or torch.float32).itemsize
    elements = sum(numel[p] for p in paths)
    assert len(paths) == 2 * 7  # each block's 7 linears; the head stays in high precision
    # Each block's params are gathered twice (the forward, and again for the backward), its
    # fp8 weights in one all-gather with its norms (as bytes); the 14 weights' float32 amaxes
    # are all-reduced once, as the step starts (a step does not change the stored shards);
    # the grads are reduce-scattered together as before.
    gathers = 2 * 2
    saved = gathers // 2 * elements * (width - 1)
    assert plain.total_bytes("all_gather") - fp8.total_bytes("all_gather") == saved
    assert fp8.count[("all_gather", "fsdp")] == plain.count[("all_gather", "fsdp")]
    assert fp8.count[("all_reduce", "fsdp")] == 1
    assert fp8.bytes[("all_reduce", "fsdp")] == len(paths) * 4
    assert ("all_reduce", "fsdp") not in plain.count
    assert fp8.count[("reduce_scatter", "fsdp")] == plain.count[("reduce_scatter", "fsdp")]
    assert fp8.bytes[("reduce_scatter", "fsdp")] == plain.bytes[("reduce_scatter", "fsdp")]
    assert fp8_memory == plain_memory


def test_fp8_amaxes_all_reduced_once_per_step_whatever_the_microbatches():
    """Two microbatches gather every unit four times, each with the amaxes the step took as
    it started: still one all-reduce of one float32 per fp8 weight."""
    stats, _, paths, _ = run_on_ranks(_comms, 2, True, None, 2)[0]
    assert stats.count[("all_reduce", "fsdp")] == 1
    assert stats.bytes[("all_reduce", "fsdp")] == len(paths) * 4


def test_fp8_gather_under_pipeline_counted():
    """Under pp=2 each stage (one block) gathers its params once a step, whatever the
    microbatches: one all-gather with its 7 fp8 weights at 1 byte an element, after one
    all-reduce of their 7 float32 amaxes."""

    def both():
        return _comms(False, None, pp=2), _comms(True, None, pp=2)

    for (plain, _, _, _), (fp8, _, paths, numel) in run_on_ranks(both, 4, method="fork"):
        elements = sum(numel[p] for p in paths)
        assert len(paths) == 7
        saved = plain.total_bytes("all_gather") - fp8.total_bytes("all_gather")
        assert saved == elements * (4 - 1)  # the gathered weights, 3 B an element less
        assert fp8.count[("all_gather", "fsdp")] == plain.count[("all_gather", "fsdp")] == 1
        assert fp8.count[("all_reduce", "fsdp")] == 1
        assert fp8.bytes[("all_reduce", "fsdp")] == 7 * 4
        assert fp8.bytes[("reduce_scatter", "fsdp")] == plain.bytes[("reduce_scatter", "fsdp")]


def test_fp8_gather_refuses_other_recipes():
    with pytest.raises(PlanError, match=r"recipe='rowwise', gather_in_fp8=True.*tensorwise"):
        d9d.fp8(recipe="rowwise", gather_in_fp8=True)
    with pytest.raises(PlanError, match=r"recipe='blockwise', gather_in_fp8=True"):
        d9d.fp8(recipe="blockwise", gather_in_fp8=True)


def test_fp8_gather_without_shard_params_refused():
    model = llama()()
    step = d9d.fp8(recipe="tensorwise", gather_in_fp8=True)(lambda p, s, b: (p, s, {}))
    with pytest.raises(PlanError, match=r"gather_in_fp8=True\) found no fp8 linear.*shard_params"):
        step.place(model.params, (), model=model)


def _jit_rank(order: str) -> list[tuple]:
    """3 AdamW steps (clipping) of the fp8-gathered step eager and under
    ``d9d.jit(backend="aot_eager", fullgraph=True)``, float32 on fsdp=2, each gathered unit
    gathered again for the backward (``reshard_after_forward``, the default; under jit by
    ``shard_params``' graph pass): losses, params, the traces, and the collectives of the
    eager step (``step.comms``) and of the compiled graphs."""

    def build():
        mesh = d9d.make_mesh("cpu", fsdp=2)
        model, opt = llama(torch.float32, 1)(), optimizer()
        storage = d9d.shard_params(mesh)
        fp8 = d9d.fp8(mesh, "tensorwise", gather_in_fp8=True)
        inner, outer = (fp8, storage) if order == "shard_params outside" else (storage, fp8)
        return mesh, outer(inner(train_step(model, opt))), model, opt

    data = batches(256, global_batch=4, seq_len=16, steps=3)
    return eager_and_jitted(build, data, backend="aot_eager", fullgraph=True)


@pytest.mark.compile
def test_fp8_gather_under_jit_bitwise_eager_with_its_collectives():
    """Under ``d9d.jit`` the gathered weight is the codec's plain ``(weight, data, scale)``:
    one graph traced once, the eager fp8-gathered step bit for bit, and the same
    collectives, count and bytes: e4m3 gathers and one all-reduce of the weights' amaxes a
    step, as ``test_fp8_gather_bytes_counted`` counts them in eager."""
    for eager, jitted in run_on_ranks(_jit_rank, 2, "shard_params outside", timeout=300):
        assert_bitwise_in_one_graph(eager, jitted)


def _gather_directly(mesh_size: int) -> None:
    """The core's two gathers with the fp8 codec: one param alone (``gather``), and one in a
    group with a float32 param of another wire dtype (``gather_many``: a byte buffer, the
    fp8 piece of 6 bytes a rank padded to 8), on uneven shards."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from d9d.core._gather import gather, gather_many
    from d9d.core._param_plan import ParamPlan
    from d9d.kernels import fp8_quantize
    from d9d.transforms.fp8._gather import Fp8Gather

    mesh = d9d.make_mesh("cpu", fsdp=mesh_size)
    # A generator of its own: ranks are threads, and the global one is the process's (two
    # ranks drawing from it at once got different weights).
    g = torch.Generator().manual_seed(0)
    weight, other = torch.randn(3, 3, generator=g) * 5, torch.randn(5, generator=g)

    def entry(path, tensor, codec):
        return ParamPlan(
            path, tuple(tensor.shape), tensor.dtype, None, (Shard(0),), (Replicate(),),
            (Partial("avg"),), codec=codec,
        )  # fmt: skip

    fp8 = entry("w", weight, Fp8Gather(torch.float32))
    plain = entry("b", other, None)
    stored = [d9d.core._gather.distribute(t, mesh, (Shard(0),)) for t in (weight, other)]
    data, scale = fp8_quantize(weight, "tensorwise")
    alone = gather(stored[0], mesh, fp8)
    together, whole = gather_many(stored, mesh, [fp8, plain], 0, (mesh.get_group(0).group_name,))
    for got in (alone, together):
        assert torch.equal(got.fp8_data.view(torch.uint8), data.view(torch.uint8))
        assert torch.equal(got.fp8_scale, scale)
    assert torch.equal(whole, other)


def test_the_core_gathers_the_fp8_codec_alone_and_beside_another_wire_dtype():
    run_on_ranks(_gather_directly, 2, 2)
