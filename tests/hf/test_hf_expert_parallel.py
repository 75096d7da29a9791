"""Hugging Face MoE models under ``expert_parallel``, through ``transformers``' own experts
interface: Qwen3-MoE and Mixtral (4 experts, top-2, both layers sparse) under ``ep=2``, and
Qwen3-MoE under ``ep=2 x fsdp=2``, equal one device fed the whole batch (float64, 5 AdamW
steps, uneven ignored labels), and with the grouped_mm implementation in float32; so does
GPT-OSS at ``ep=2``, its experts' biases split over ep as their weights are; each rank stores
half the experts, and one step's all-to-all bytes follow from its routing; an experts module
of another interface is refused by name (``docs/moe.md``)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
from equivalence import assert_equivalent, optimizer, reference, train_step
from hf_families import build, data
from hf_families import config as hf_config

import d9d
from d9d.errors import RankFailedError
from d9d.kernels import DispatchGroup
from d9d.testing import run_on_ranks
from d9d.transforms.expert_parallel._hf_experts import dispatched

pytestmark = pytest.mark.distributed

STEPS = 5
EXPERTS = {"qwen3_moe": {"num_experts": 4}, "mixtral": {"num_local_experts": 4}}
LAYOUTS = {
    "ep=2": ({"ep": 2}, lambda mesh: [d9d.expert_parallel(mesh)]),
    "ep=2 x fsdp=2": (
        {"ep": 2, "fsdp": 2},
        lambda mesh: [d9d.expert_parallel(mesh), d9d.shard_params(mesh, "fsdp")],
    ),
}


@functools.cache
def _reference(family: str):
    return reference(build(family, **EXPERTS[family]), data(STEPS))


@pytest.mark.parametrize(
    ("family", "layout"),
    [("qwen3_moe", "ep=2"), ("mixtral", "ep=2"), ("qwen3_moe", "ep=2 x fsdp=2")],
)
def test_hugging_face_moe_under_ep_equals_one_device(family: str, layout: str) -> None:
    mesh_axes, transforms = LAYOUTS[layout]
    model_fn = build(family, **EXPERTS[family])
    expected = _reference(family)
    assert_equivalent(model_fn, transforms, mesh_axes, data(STEPS), expected, dtype=torch.float64)


@functools.cache
def _grouped_mm_qwen3_moe() -> Callable[[], d9d.Model]:
    """Qwen3-MoE with transformers' grouped_mm experts, in float32 (which it needs on CPU),
    built here, copied per rank."""
    module = build("qwen3_moe", **EXPERTS["qwen3_moe"], experts_implementation="grouped_mm")()
    module = module.module.to(torch.float32)
    return lambda: d9d.functionalize(copy.deepcopy(module))


def test_grouped_mm_experts_under_ep_equal_one_device() -> None:
    """transformers' grouped_mm implementation reads num_experts for its group offsets: the
    runtime's num_experts of E / ep for the call is what makes it run on the rank's experts.
    SGD: AdamW would turn float32 rounding of a param whose grad is near its eps into 1e-7
    (measured: one lm_head element of 2e-3)."""
    model_fn = _grouped_mm_qwen3_moe()
    expected = reference(model_fn, data(STEPS), opt="sgd")
    transforms = LAYOUTS["ep=2"][1]
    assert_equivalent(
        model_fn,
        transforms,
        {"ep": 2},
        data(STEPS),
        expected,
        dtype=torch.float32,
        opt="sgd",
    )


def _split_rank(model_fn, paths: tuple[str, ...]):
    mesh = d9d.make_mesh("cpu", ep=2)
    model, opt = model_fn(), optimizer()
    step = d9d.expert_parallel(mesh)(train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    placed = {p: (step.plan.explain(p), tuple(params[p].to_local().shape)) for p in paths}
    return placed, step.memory(params, state)


def test_gpt_oss_under_ep_equals_one_device_its_expert_biases_split() -> None:
    """GPT-OSS (the sweep's tiny config: 4 experts, top-2, experts with biases and a clamped
    swiglu, attention sinks) at ep=2 equals one device. Its experts module's params are split
    over ep by what they are, params of transformers' experts interface, each rank holding 2
    of the 4 experts of each: the biases too, though ``down_proj_bias [E, H]`` has the logical
    axes of its router's ``weight [E, H]``, which stays whole with the router's bias."""
    model_fn = _sweep_family("gpt_oss")
    expected = reference(model_fn, data(STEPS))
    assert_equivalent(
        model_fn, LAYOUTS["ep=2"][1], {"ep": 2}, data(STEPS), expected, dtype=torch.float64
    )
    layer = "model.layers.0.mlp."
    split = {"experts.gate_up_proj_bias": (2, 80), "experts.down_proj_bias": (2, 48)}
    whole = {"router.weight": (4, 48), "router.bias": (4,)}
    paths = tuple(layer + name for name in (*split, *whole))
    params = model_fn().params
    experts = sum(v.numel() * 8 for n, v in params.items() if ".experts." in n)
    dense = sum(v.numel() * 8 for n, v in params.items() if ".experts." not in n)
    for placed, memory in run_on_ranks(_split_rank, 2, model_fn, paths):
        for name, shape in split.items():
            why, local = placed[layer + name]
            assert "2 of 4 experts per rank of 'ep'" in why and "grads scaled by 1/2" in why
            assert local == shape
        for name, shape in whole.items():
            why, local = placed[layer + name]
            assert "replicated over 'ep'" in why and local == shape
        assert memory.params == dense + experts // 2


def _routed_ids(model: d9d.Model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The top-k ids each experts module is called with on one device, layer by layer."""
    seen: list[torch.Tensor] = []
    modules = [m for p, m in model.module.named_modules() if p.endswith("mlp.experts")]
    hooks = [m.register_forward_hook(lambda m, args, out: seen.append(args[1])) for m in modules]
    try:
        model.apply(model.params, tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _inspect_rank(model_fn):
    mesh = d9d.make_mesh("cpu", ep=2)
    model, opt = model_fn(), optimizer()
    step = d9d.expert_parallel(mesh)(train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    comms = step.comms(params, state, step.shard_batch(data(1)[0]))
    local = params["model.layers.0.mlp.experts.gate_up_proj"].to_local().shape
    return (
        step.plan.explain("model.layers.0.mlp.experts.down_proj"),
        step.memory(params, state),
        comms,
        local,
    )


def test_plan_memory_and_all_to_all_bytes() -> None:
    """Qwen3-MoE at ep=2, 2 rows of 8 tokens per rank, top-2 of 4 experts in each of its 2
    layers, hidden 48, float64. Each layer's dispatch and combine run 8 all-to-alls a step
    (counts, tokens, ids, weights forward; their grads backward): the counts (per rank: its
    tokens and its 2 experts' choices, 3 int64), the tokens that leave the rank (once per
    destination rank) with their ids (int32) and weights, one row back per token received,
    and the same backward. Which tokens leave follows from the step's routing, recorded on one
    device per rank's rows. Each rank stores half the experts' bytes."""
    ranks, experts, k, hidden = 2, 4, 2, 48
    model_fn = build("qwen3_moe", **EXPERTS["qwen3_moe"])
    model = model_fn()
    tokens = data(1)[0]["tokens"]
    ids = [_routed_ids(model, rows) for rows in tokens.chunk(ranks)]
    expert_bytes = sum(v.numel() * 8 for n, v in model.params.items() if ".experts." in n)
    dense_bytes = sum(v.numel() * 8 for n, v in model.params.items() if ".experts." not in n)
    for rank, (why, memory, comms, local) in enumerate(
        run_on_ranks(_inspect_rank, ranks, model_fn)
    ):
        assert "2 of 4 experts per rank of 'ep'" in why and "grads scaled by 1/2" in why
        assert tuple(local) == (experts // ranks, 2 * 16, hidden)
        assert memory.params == dense_bytes + expert_bytes // ranks
        moved = 0
        for mine, theirs in zip(ids[rank], ids[1 - rank], strict=True):
            sent = int(((mine // 2) == 1 - rank).any(1).sum())
            received = int(((theirs // 2) == rank).any(1).sum())
            assert 0 < sent < 16 and 0 < received < 16
            counts = ranks * (experts // ranks + 1) * 8
            rows = 2 * (sent + received) * hidden * 8
            moved += counts + rows + sent * k * 4 + (sent + received) * k * 8
        assert comms.count[("all_to_all", "ep")] == 8 * 2
        assert comms.bytes[("all_to_all", "ep")] == moved


def _place(model_fn) -> None:
    mesh = d9d.make_mesh("cpu", ep=2)
    model = model_fn()
    step = d9d.expert_parallel(mesh)(lambda p, s, b: (p, s, {}))
    step.place(model.params, (), model=model)


def _no_rows_rank(module, x, ids, weights, grad):
    group = d9d.make_mesh("cpu", ep=2).get_group("ep")
    rank = group.rank()
    local = copy.deepcopy(module)
    for name, param in list(local.named_parameters()):
        setattr(local, name, torch.nn.Parameter(param.detach()[2 * rank : 2 * rank + 2].clone()))
    local.num_experts = 2
    x, weights = (t.chunk(2)[rank].clone().requires_grad_() for t in (x, weights))
    out = dispatched(local, x, ids.chunk(2)[rank], weights, 4, DispatchGroup.of(group))
    out.backward(grad.chunk(2)[rank])
    # rank 1's experts see no row: no grad, which is zero
    grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in local.named_parameters()
    }
    return out, x.grad, weights.grad, grads


def test_a_rank_no_row_reaches_runs_the_backward_all_to_alls() -> None:
    """Every token of both ranks chooses experts 0 and 1 (rank 0's): rank 1 receives no row,
    and transformers' eager loop returns it zeros unconnected to them. Its backward still
    runs the reverse all-to-alls rank 0 runs, and outputs and grads equal the module's on
    one device."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = hf_config("qwen3_moe", num_experts=4)
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = Qwen3MoeExperts(config).to(torch.float64)
        for param in module.parameters():
            torch.nn.init.normal_(param, std=0.1)
    x = torch.randn(6, 48, dtype=torch.float64, generator=g)
    ids = torch.tensor([[0, 1], [1, 0]] * 3)
    weights = torch.rand(6, 2, dtype=torch.float64, generator=g)
    grad = torch.randn(6, 48, dtype=torch.float64, generator=g)
    want_x, want_w = x.clone().requires_grad_(), weights.clone().requires_grad_()
    want = module(want_x, ids, want_w)
    want.backward(grad)
    ranks = run_on_ranks(_no_rows_rank, 2, module, x, ids, weights, grad, timeout=60)
    for rank, (out, x_grad, w_grad, param_grads) in enumerate(ranks):
        rows = slice(3 * rank, 3 * rank + 3)
        torch.testing.assert_close(out, want[rows], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(x_grad, want_x.grad[rows], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(w_grad, want_w.grad[rows], rtol=1e-12, atol=1e-14)
        for name, param in module.named_parameters():
            torch.testing.assert_close(
                param_grads[name], param.grad[2 * rank : 2 * rank + 2], rtol=1e-12, atol=1e-14
            )


class _Experts(torch.nn.Module):
    """Stacked experts of no library's interface."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 8, 6))


class _Custom(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = _Experts()


def _misnumbered_qwen3_moe() -> Callable[[], d9d.Model]:
    model_fn = build("qwen3_moe", **EXPERTS["qwen3_moe"])

    def misnumbered() -> d9d.Model:
        model = model_fn()
        model.module.model.layers[0].mlp.experts.num_experts = 5
        return model

    return misnumbered


def _sweep_family(family: str) -> Callable[[], d9d.Model]:
    import sweep

    return sweep.build(family)


# Each case: (a builder of the model builder, run here: transformers' lazy imports are not
# thread-safe, so no rank thread builds a transformers model; the message).
REFUSALS = {
    # transformers' Llama-4 experts take the tokens already scaled by their router scores,
    # every token through every expert: experts(hidden_states).
    "llama4_text": (
        lambda: _sweep_family("llama4_text"),
        r"'model\.layers\.0\.feed_forward\.experts\.gate_up_proj' belongs to module "
        r"'model\.layers\.0\.feed_forward\.experts' \(Llama4TextExperts\), which expert_parallel "
        r"cannot run on the rows it dispatches: Llama4TextExperts is called as "
        r"experts\(hidden_states\), not as experts\(hidden_states \[T, H\], top_k_index \[T, k\], "
        r"top_k_weights \[T, k\]\); expert_parallel cannot run the 'llama4_text' family's "
        r"experts; shard them with d9d\.shard_params\(mesh, axis='ep'\) instead",
    ),
    "qwen3_moe, num_experts changed": (
        _misnumbered_qwen3_moe,
        r".* \(Qwen3MoeExperts\), which expert_parallel cannot run on the rows it dispatches: "
        r"Qwen3MoeExperts\.num_experts is 5, not its 4 experts, which transformers' experts "
        r"implementations read; d9d\.checkpoint\.import_hf_moe converts a Qwen3-MoE checkpoint "
        r"to d9d\.models\.MoE",
    ),
    "not transformers": (
        lambda: (
            lambda: d9d.functionalize(_Custom(), axes={r"w$": ("experts", "embed", "expert_mlp")})
        ),
        r"'experts\.w' belongs to module 'experts' \(_Experts\), which expert_parallel cannot "
        r"run on the rows it dispatches: _Experts is not a transformers module; build the "
        r"model's MoE layers from d9d\.moe",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_other_experts_modules_are_refused_with_why_and_a_fix(case: str) -> None:
    builder, message = REFUSALS[case]
    model_fn = builder()
    with pytest.raises(
        RankFailedError, match=r"PlanError: expert_parallel\(axis='ep'\): " + message
    ):
        run_on_ranks(_place, 2, model_fn, timeout=120)
