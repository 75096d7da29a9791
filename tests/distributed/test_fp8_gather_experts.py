"""``fp8(gather_in_fp8=True)`` on the routed experts' stacked weights ``[E, K, N]``: e4m3
data and one scale per expert (``d9d/transforms/fp8/_gather.py``, the note on experts).

The fp8 grouped GEMM scales each expert's weight by its own amax, so the codec's statistic
is one amax per expert (``statistic_dim = 0``), which the core reduces expert by expert:
under ``shard_params`` alone the experts are ``Shard(0)`` over ``fsdp`` (each rank holds
whole experts, laid at their offset before the all-reduce), under ``expert_parallel`` x
``shard_params`` ``Shard(0)`` over ``ep`` and ``Shard(1)`` over ``fsdp`` (the rank's experts'
amaxes all-reduced over ``fsdp``).

Exact: the gathered data and scales are ``fp8_quantize`` of the whole weight (the core's
gathers, uneven shards), so the step is bitwise the fp8 step without the fp8 gather (3
AdamW steps of the tiny MoE, fsdp=2 and ep=2 x fsdp=2). Not bitwise one device: each rank
routes its own batch, so an expert's activation and grad scales are taken over that rank's
(or its ep group's) rows (``test_fp8_moe.py`` bounds that noise). Counted: each gather of
an experts weight moves 1 byte an element (half of bfloat16's), and its scales, a float32
per expert, join the step's one amax all-reduce.
"""

from __future__ import annotations

import math

import pytest
import torch
from moe_steps import batches, optimizer
from torch.distributed.tensor import Partial, Replicate, Shard

import d9d
from d9d.core._gather import distribute, gather, gather_many
from d9d.core._param_plan import ParamPlan
from d9d.kernels import fp8_quantize
from d9d.models import MoE, MoEConfig
from d9d.models.moe import make_train_step
from d9d.testing import run_on_ranks
from d9d.transforms.fp8._gather import Fp8Gather

pytestmark = pytest.mark.distributed

EXPERTS = tuple(f"layers.1.mlp.experts.{w}" for w in ("w_gate", "w_up", "w_down"))
LAYOUTS = {"fsdp=2": {"fsdp": 2}, "ep=2 x fsdp=2": {"ep": 2, "fsdp": 2}}


def _step(mesh, step, axes: dict[str, int], gather: bool, **fp8_options):
    if "ep" in axes:
        step = d9d.expert_parallel(mesh)(step)
    step = d9d.shard_params(mesh, param_dtype=fp8_options.pop("param_dtype", None))(step)
    return d9d.fp8(mesh, "tensorwise", gather_in_fp8=gather, **fp8_options)(step)


def _trained(axes: dict[str, int], gather: bool):
    """Losses of 3 AdamW steps (clipping, aux losses, the router bias) and the final params."""
    mesh = d9d.make_mesh("cpu", **axes)
    model, opt = d9d.functionalize(MoE(MoEConfig.tiny())), optimizer()
    step = _step(mesh, make_train_step(model, opt), axes, gather)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    codecs = {p: step.plan[p].codec for p in EXPERTS}
    losses = []
    for batch in batches()[:3]:
        params, state, metrics = step(params, state, step.shard_batch(batch))
        losses.append(metrics["loss"])
    return torch.stack(losses), {k: v.full_tensor() for k, v in params.items()}, codecs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_gather_of_the_experts_bitwise_the_fp8_step_without_it(layout):
    axes = LAYOUTS[layout]
    ranks = math.prod(axes.values())
    want = run_on_ranks(_trained, ranks, axes, False, timeout=300)
    got = run_on_ranks(_trained, ranks, axes, True, timeout=300)
    for (losses, params, codecs), (want_losses, want_params, plain) in zip(got, want, strict=True):
        assert all(codecs[p] == Fp8Gather(torch.float32, stacked=True) for p in EXPERTS)
        assert all(plain[p] is None for p in EXPERTS)
        assert torch.equal(losses, want_losses), (losses, want_losses)
        for path, value in params.items():
            assert torch.equal(value, want_params[path]), path


def _comms(axes: dict[str, int], gather: bool):
    """One grad step's collectives with only the experts in fp8, gathered in bfloat16 or
    fp8; its per-rank memory; and each rank's experts weights' ``(elements, experts)`` as
    it computes them."""
    mesh = d9d.make_mesh("cpu", **axes)
    model = d9d.functionalize(MoE(MoEConfig.tiny()))

    def loss_fn(params, batch):
        out = model.apply(params, batch["tokens"])
        return d9d.losses.cross_entropy(out.logits, batch["labels"]) + out.aux_loss

    step = lambda p, s, b: (d9d.grad(loss_fn)(p, b), s, {})  # noqa: E731
    step = _step(mesh, step, axes, gather, include="experts", param_dtype=torch.bfloat16)
    params, _ = step.place(model.params, (), model=model)
    computed = [step.plan[p].local_shape(mesh, step.plan[p].compute) for p in EXPERTS]
    stats = step.comms(params, (), step.shard_batch(batches()[0]))
    memory = step.memory(params, ())
    return stats, memory, [(math.prod(shape), shape[0]) for shape in computed]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_gather_of_the_experts_counted(layout):
    """Block 1 is gathered twice (the forward, and again for the backward): its experts
    weights move 1 byte an element each time instead of bfloat16's 2; their scales, one
    float32 per expert the rank computes with (all 6 at fsdp=2, its 3 at ep=2 x fsdp=2),
    take one all-reduce more a step; nothing else changes, per-rank memory neither (it counts
    stored params, grads and state, not gathered weights)."""
    axes = LAYOUTS[layout]
    ranks = math.prod(axes.values())
    plain_ranks = run_on_ranks(_comms, ranks, axes, False)
    fp8_ranks = run_on_ranks(_comms, ranks, axes, True)
    for (plain, plain_memory, sizes), (fp8, memory, _) in zip(plain_ranks, fp8_ranks, strict=True):
        elements, experts = sum(n for n, _ in sizes), sum(e for _, e in sizes)
        assert experts == (6 if layout == "fsdp=2" else 3) * 3
        bf16 = 2 * elements * torch.bfloat16.itemsize  # block 1's two gathers of its experts
        saved = plain.total_bytes("all_gather") - fp8.total_bytes("all_gather")
        assert saved == bf16 // 2
        assert fp8.count[("all_gather", "fsdp")] == plain.count[("all_gather", "fsdp")]
        assert fp8.count[("all_reduce", "fsdp")] == plain.count[("all_reduce", "fsdp")] + 1
        scales = fp8.bytes[("all_reduce", "fsdp")] - plain.bytes[("all_reduce", "fsdp")]
        assert scales == experts * 4
        rest = set(plain.count) - {("all_gather", "fsdp"), ("all_reduce", "fsdp")}
        assert {k: fp8.bytes[k] for k in rest} == {k: plain.bytes[k] for k in rest}
        assert memory == plain_memory


class _OneValueTooMany(Fp8Gather):
    def statistic(self, shard: torch.Tensor) -> torch.Tensor:
        return torch.cat([super().statistic(shard), shard.new_zeros(1)])


def _gather_experts_directly() -> None:
    """The core's two gathers of a stack of 5 experts (one all zero) with the fp8 codec:
    ``Shard(0)`` (3 and 2 experts a rank) and ``Shard(1)`` (rows 2 and 1), alone
    (``gather``) and beside a float32 param (``gather_many``): the data and scales of
    ``fp8_quantize`` of the whole stack, one scale per expert."""
    mesh = d9d.make_mesh("cpu", fsdp=2)
    g = torch.Generator().manual_seed(0)  # not the process's: ranks are threads
    weight, other = torch.randn(5, 3, 4, generator=g) * 5, torch.randn(5, generator=g)
    weight[3] = 0
    want_data, want_scale = fp8_quantize(weight, "tensorwise")
    group = (mesh.get_group(0).group_name,)

    def entry(path, tensor, dim, codec):
        return ParamPlan(
            path, tuple(tensor.shape), tensor.dtype, None, (Shard(dim),), (Replicate(),),
            (Partial("avg"),), codec=codec,
        )  # fmt: skip

    for dim in (0, 1):
        fp8 = entry("w", weight, dim, Fp8Gather(torch.float32, stacked=True))
        plain = entry("b", other, 0, None)
        stored = [distribute(t, mesh, (Shard(d),)) for t, d in ((weight, dim), (other, 0))]
        alone = gather(stored[0], mesh, fp8)
        together, whole = gather_many(stored, mesh, [fp8, plain], 0, group)
        for got in (alone, together):
            assert torch.equal(got.fp8_data.view(torch.uint8), want_data.view(torch.uint8))
            assert torch.equal(got.fp8_scale, want_scale)
        assert torch.equal(whole, other)
        wrong = entry("w", weight, dim, _OneValueTooMany(torch.float32, stacked=True))
        with pytest.raises(ValueError, match=r"w: its gather codec's statistic has \d values"):
            gather(stored[0], mesh, wrong)


def test_the_core_gathers_a_stack_of_experts_with_a_scale_per_expert():
    run_on_ranks(_gather_experts_directly, 2)
