"""``fp8(gather_in_fp8=True)`` on the routed experts' stacked weights ``[E, K, N]``: e4m3
data and one scale per expert (``d9d/transforms/fp8/_gather.py``, the note on experts).

The fp8 grouped GEMM scales each expert's weight by its own amax, so the codec's statistic
is one amax per expert (``statistic_dim = 0``), which the core reduces expert by expert:
under ``shard_params`` alone the experts are ``Shard(0)`` over ``fsdp`` (each rank holds
whole experts, laid at their offset before the all-reduce), under ``expert_parallel`` x
``shard_params`` ``Shard(0)`` over ``ep`` and ``Shard(1)`` over ``fsdp`` (the rank's experts'
amaxes all-reduced over ``fsdp``). Under ``pipeline`` a stage's experts are ``Shard(0)``
over ``fsdp`` as alone, on the stage's mesh (no ``pp`` axis); under HSDP
(``replicate_axis="dp"``) too, on a mesh whose ``fsdp`` is the second axis (the offsets come
from the rank's ``fsdp`` coordinate), their amaxes reduced over ``fsdp`` only (the ``dp``
replicas hold the same shards).

Exact: the gathered data and scales are ``fp8_quantize`` of the whole weight (the core's
gathers, uneven shards), so the step is bitwise the fp8 step without the fp8 gather (3
AdamW steps of the tiny MoE, the whole model in fp8: its attention linears and the dense
block's MLP gathered in fp8 too; fsdp=2, ep=2 x fsdp=2, pp=2 x fsdp=2 and dp=2 x fsdp=2).
Not bitwise one device: each rank routes its own batch, so an expert's activation and grad
scales are taken over that rank's (or its ep group's) rows (``test_fp8_moe.py`` bounds that
noise). Counted: each gather of an fp8 weight moves 1 byte an element (half of bfloat16's),
and its scales, a float32 per expert or per linear, join the step's one amax all-reduce.
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
ATTENTION = tuple(f"layers.1.attn.{w}.weight" for w in ("wq", "wk", "wv", "wo"))
# Under pp=2 both blocks are MoE, so that each stage gathers experts (the tiny MoE's first
# block is dense otherwise).
LAYOUTS = {
    "fsdp=2": ({"fsdp": 2}, {}),
    "ep=2 x fsdp=2": ({"ep": 2, "fsdp": 2}, {}),
    "pp=2 x fsdp=2": ({"pp": 2, "fsdp": 2}, {"n_dense_layers": 0}),
    "dp=2 x fsdp=2": ({"dp": 2, "fsdp": 2}, {}),  # HSDP
}


def _method(axes: dict[str, int]) -> str:
    """Threads have no point-to-point ops: a pipeline runs in forked processes."""
    return "fork" if "pp" in axes else "thread"


def _step(mesh, step, axes: dict[str, int], gather: bool, **fp8_options):
    if "ep" in axes:
        step = d9d.expert_parallel(mesh)(step)
    if "pp" in axes:
        step = d9d.pipeline(mesh, schedule="1f1b", microbatches=2)(step)
    replicate = "dp" if "dp" in axes else None
    dtype = fp8_options.pop("param_dtype", None)
    step = d9d.shard_params(mesh, replicate_axis=replicate, param_dtype=dtype)(step)
    return d9d.fp8(mesh, "tensorwise", gather_in_fp8=gather, **fp8_options)(step)


def _trained(axes: dict[str, int], overrides: dict, gather: bool):
    """Losses of 3 AdamW steps (clipping, aux losses, the router bias) and the final params
    (a stage's under a pipeline)."""
    mesh = d9d.make_mesh("cpu", **axes)
    model, opt = d9d.functionalize(MoE(MoEConfig.tiny(**overrides))), optimizer()
    step = _step(mesh, make_train_step(model, opt), axes, gather)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    codecs = {p: step.plan[p].codec for p in (*EXPERTS, *ATTENTION)}
    losses = []
    for batch in batches()[:3]:
        params, state, metrics = step(params, state, step.shard_batch(batch))
        losses.append(metrics["loss"])
    return torch.stack(losses), {k: v.full_tensor() for k, v in params.items()}, codecs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_gather_of_the_experts_bitwise_the_fp8_step_without_it(layout):
    """The whole tiny MoE in fp8, its attention linears and experts gathered in fp8 (and
    its dense block's MLP): losses and params of 3 AdamW steps bitwise the fp8 step that
    gathers them in float32."""
    axes, overrides = LAYOUTS[layout]
    ranks, method = math.prod(axes.values()), _method(axes)
    want = run_on_ranks(_trained, ranks, axes, overrides, False, method=method, timeout=300)
    got = run_on_ranks(_trained, ranks, axes, overrides, True, method=method, timeout=300)
    for (losses, params, codecs), (want_losses, want_params, plain) in zip(got, want, strict=True):
        assert all(codecs[p] == Fp8Gather(torch.float32, stacked=True) for p in EXPERTS)
        assert all(codecs[p] == Fp8Gather(torch.float32) for p in ATTENTION)
        assert all(codec is None for codec in plain.values())
        assert torch.equal(losses, want_losses), (losses, want_losses)
        for path, value in params.items():
            assert torch.equal(value, want_params[path]), path


def _comms(axes: dict[str, int], overrides: dict, gather: bool):
    """One grad step's collectives with the whole model in fp8, its weights gathered in
    bfloat16 or fp8; its per-rank memory; and each weight the rank gathers in fp8 as
    ``(elements, scales)`` as it computes with it (scales: its experts, or 1 for a linear)."""
    mesh = d9d.make_mesh("cpu", **axes)
    model = d9d.functionalize(MoE(MoEConfig.tiny(**overrides)))

    def loss_fn(params, batch):
        out = model.apply(params, batch["tokens"])
        return d9d.losses.cross_entropy(out.logits, batch["labels"]) + out.aux_loss

    step = lambda p, s, b: (d9d.grad(loss_fn)(p, b), s, {})  # noqa: E731
    step = _step(mesh, step, axes, gather, param_dtype=torch.bfloat16)
    params, _ = step.place(model.params, (), model=model)
    plan, sizes = step.plan, {}
    for path in [p for p in plan.held if isinstance(plan[p].codec, Fp8Gather)]:
        shape = plan[path].local_shape(plan.mesh, plan[path].compute)
        sizes[path] = (math.prod(shape), shape[0] if plan[path].codec.stacked else 1)
    stats = step.comms(params, (), step.shard_batch(batches()[0]))
    return stats, step.memory(params, ()), sizes


# The linears a rank gathers in fp8: each block's attention (4) and the dense block's MLP (3);
# the shared expert (width 40, no multiple of 16), routers and head stay in high precision.
LINEARS = {"fsdp=2": 11, "ep=2 x fsdp=2": 11, "pp=2 x fsdp=2": 4, "dp=2 x fsdp=2": 11}


# The collectives the fp8 gather changes: the weights' all-gather and the amaxes' all-reduce.
FP8_GATHER = {("all_gather", "fsdp"), ("all_reduce", "fsdp")}


def _others(counted: dict) -> dict:
    """``counted`` but for :data:`FP8_GATHER`: HSDP's ``dp`` collectives among them."""
    return {k: v for k, v in counted.items() if k not in FP8_GATHER}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_gather_of_the_experts_counted(layout):
    """Each block is gathered twice a step (the forward, and again for the backward; once
    under a pipeline, whose stage gathers its params once for its microbatches): its fp8
    weights move 1 byte an element each time instead of bfloat16's 2; their scales, one
    float32 per expert the rank computes with (all 6 but at ep=2 x fsdp=2, its 3) and per
    linear, take one all-reduce more a step, over ``fsdp`` only (not HSDP's ``dp``);
    nothing else changes, per-rank memory neither (it counts stored params, grads and
    state, not gathered weights)."""
    axes, overrides = LAYOUTS[layout]
    ranks, method = math.prod(axes.values()), _method(axes)
    plain_ranks = run_on_ranks(_comms, ranks, axes, overrides, False, method=method)
    fp8_ranks = run_on_ranks(_comms, ranks, axes, overrides, True, method=method)
    gathers = 1 if "pp" in axes else 2
    for (plain, plain_memory, _), (fp8, memory, sizes) in zip(plain_ranks, fp8_ranks, strict=True):
        experts = [s for p, (_, s) in sizes.items() if ".experts." in p]
        assert len(experts) == 3 and sum(experts) == 3 * 6 // axes.get("ep", 1)
        assert len(sizes) - len(experts) == LINEARS[layout]
        elements = sum(n for n, _ in sizes.values())
        saved = plain.total_bytes("all_gather") - fp8.total_bytes("all_gather")
        assert saved == gathers * elements * torch.bfloat16.itemsize // 2
        assert fp8.count[("all_gather", "fsdp")] == plain.count[("all_gather", "fsdp")]
        assert fp8.count[("all_reduce", "fsdp")] == plain.count[("all_reduce", "fsdp")] + 1
        scales = fp8.bytes[("all_reduce", "fsdp")] - plain.bytes[("all_reduce", "fsdp")]
        assert scales == sum(s for _, s in sizes.values()) * 4
        assert _others(fp8.bytes) == _others(plain.bytes)
        assert _others(fp8.count) == _others(plain.count)
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
