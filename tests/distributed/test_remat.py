"""``remat``: grads bitwise equal to the same step without it, on one device and under every
transform; and what each policy keeps per block."""

from __future__ import annotations

import collections
import doctest
import importlib
import math
import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo.backends.debugging
import torch._inductor.compile_fx
from torch import fx
from torch.distributed.tensor import DTensor

import d9d
from d9d.core._backward_region import in_backward
from d9d.core._context import running
from d9d.errors import PlanError, RankFailedError
from d9d.models import Llama, LlamaConfig
from d9d.models.llama._decoder import Block as LlamaBlock
from d9d.testing import KeptBytes, run_on_ranks

LAYOUTS: dict[str, tuple[dict[str, int], Callable[[Any], list[Any]]]] = {
    "one device": ({"dp": 1}, lambda mesh: []),
    "fsdp=2": ({"fsdp": 2}, lambda mesh: [d9d.shard_params(mesh)]),
    "tp=2": ({"tp": 2}, lambda mesh: [d9d.tensor_parallel(mesh)]),
    "cp=2": ({"cp": 2}, lambda mesh: [d9d.context_parallel(mesh)]),
    "pp=2": ({"pp": 2}, lambda mesh: [d9d.pipeline(mesh, microbatches=2)]),
}


def _batch() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def _model(n_layers: int = 2) -> d9d.Model:
    torch.manual_seed(0)
    config = LlamaConfig.tiny(n_layers=n_layers)
    return d9d.functionalize(Llama(config).to(torch.float64))


def _grad_step(model: d9d.Model) -> Callable[..., Any]:
    def loss_fn(params: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return d9d.losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])

    def step(params: Any, opt_state: Any, batch: dict) -> tuple[Any, Any, Any]:
        loss, grads = d9d.value_and_grad(loss_fn)(params, batch)
        return grads, opt_state, {"loss": loss}

    return step


# Zero-bubble schedules take input grads and weight grads in two backward passes: a
# checkpointed block is recomputed in each. Two stages per rank: four blocks.
def _zero_bubble(schedule: str, microbatches: int = 2) -> Callable[[Any], list[Any]]:
    return lambda mesh: [
        d9d.pipeline(mesh, schedule=schedule, microbatches=microbatches, virtual_stages=2)
    ]


ZERO_BUBBLE = {
    "pp=2 zbv": ({"pp": 2}, _zero_bubble("zbv")),
    "pp=2 interleaved_zb": ({"pp": 2}, _zero_bubble("interleaved_zb")),
    # DualPipeV runs at least as many microbatches as stages.
    "pp=2 dualpipev": ({"pp": 2}, _zero_bubble("dualpipev", microbatches=4)),
}


def _grads(layout: str, policy: str | None, every: int = 1, n_layers: int = 2) -> list[dict]:
    axes, make = {**LAYOUTS, **ZERO_BUBBLE}[layout]
    world = math.prod(axes.values())

    def rank() -> dict[str, torch.Tensor]:
        mesh = d9d.make_mesh("cpu", **axes)
        model = _model(4 if layout in ZERO_BUBBLE else n_layers)
        transforms = make(mesh)
        if policy is not None:
            transforms.append(d9d.remat(policy, every=every, mesh=mesh))
        step: Any = _grad_step(model)
        if not transforms:  # one device, no remat: the plain step on plain tensors
            grads, _, metrics = step(model.params, (), _batch())
            return {**grads, "loss": metrics["loss"]}
        for transform in transforms:
            step = transform(step)
        params, state = step.place(model.params, (), model=model)
        grads, _, metrics = step(params, state, step.shard_batch(_batch()))
        local = {p: g.to_local() if isinstance(g, DTensor) else g for p, g in grads.items()}
        return {**local, "loss": metrics["loss"]}

    return run_on_ranks(rank, world, method="fork" if "pp" in axes else "thread")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_remat_grads_bitwise_equal_no_remat(layout: str, policy: str) -> None:
    plain = _grads(layout, None)
    for rank, (want, got) in enumerate(zip(plain, _grads(layout, policy), strict=True)):
        assert want.keys() == got.keys()
        for path in want:
            assert torch.equal(want[path], got[path]), (layout, policy, rank, path)


@pytest.mark.parametrize("layout", list(ZERO_BUBBLE))
def test_full_remat_under_zero_bubble_schedules_grads_bitwise_equal_no_remat(layout: str) -> None:
    plain = _grads(layout, None)
    for rank, (want, got) in enumerate(zip(plain, _grads(layout, "full"), strict=True)):
        assert want.keys() == got.keys()
        for path in want:
            assert torch.equal(want[path], got[path]), (layout, rank, path)


def test_selective_remat_under_a_zero_bubble_schedule_is_refused_by_name() -> None:
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: pipeline\(axis='pp', schedule='zbv', .*\) takes each stage's input "
        r"grads and its weight grads in two backward passes, but under remat\(policy="
        r"'selective', every=1\) a block's kept outputs serve one backward pass .* use "
        r"remat\('full'\)",
    ):
        _grads("pp=2 zbv", "selective")


def test_remat_every_other_block() -> None:
    want, got = _grads("fsdp=2", None), _grads("fsdp=2", "full", every=2)
    for a, b in zip(want, got, strict=True):
        assert all(torch.equal(a[p], b[p]) for p in a)


def _block_runs(schedule: str, policy: str | None, microbatches: int) -> list[dict[int, int]]:
    """Per rank, how many times each block's forward ran in one step (the second: the first
    also probes the stage shapes), by block index."""

    def rank() -> dict[int, int]:
        mesh = d9d.make_mesh("cpu", pp=2)
        model = _model(4)
        index = {id(block): i for i, block in enumerate(model.module.layers)}
        runs: collections.Counter[int] = collections.Counter()
        block_forward = LlamaBlock.forward

        def counted(block: LlamaBlock, *args: Any, **kwargs: Any) -> Any:
            runs[index[id(block)]] += 1
            return block_forward(block, *args, **kwargs)

        LlamaBlock.forward = counted  # in this forked rank only
        transforms = [_zero_bubble(schedule, microbatches)(mesh)[0]]
        if policy is not None:
            transforms.append(d9d.remat(policy, mesh=mesh))
        step: Any = _grad_step(model)
        for transform in transforms:
            step = transform(step)
        params, state = step.place(model.params, (), model=model)
        batch = step.shard_batch(_batch())
        step(params, state, batch)
        runs.clear()
        step(params, state, batch)
        return dict(runs)

    return run_on_ranks(rank, 2, method="fork")


@pytest.mark.parametrize("schedule", ["zbv", "interleaved_zb"])
def test_full_remat_under_zero_bubble_recomputes_a_block_once_per_backward_pass(
    schedule: str,
) -> None:
    # Four blocks, four stages (block i is stage i): stage 0 takes its input and weight grads
    # in one backward (it sends no input grad), so its block runs twice per microbatch (the
    # forward and one recomputation); every other block three times (the forward, and one
    # recomputation in each of the input-grad and weight-grad passes), where torch's
    # weight-grad pass alone recomputed it once per weight (nine: eleven runs).
    ranks = {"zbv": ((0, 3), (1, 2)), "interleaved_zb": ((0, 2), (1, 3))}
    per_microbatch = {0: 2, 1: 3, 2: 3, 3: 3}
    want = [{b: 4 * per_microbatch[b] for b in blocks} for blocks in ranks[schedule]]
    assert _block_runs(schedule, "full", microbatches=4) == want
    assert _block_runs(schedule, None, microbatches=4) == [
        {b: 4 for b in r} for r in ranks[schedule]
    ]


@pytest.fixture
def recomputed(monkeypatch: pytest.MonkeyPatch) -> list[fx.GraphModule]:
    """The graphs ``d9d.jit`` compiles with ``aot_eager`` or ``inductor``, after the runtimes'
    graph passes (``remat``'s rematerialization, when the step has ``remat``)."""
    graphs: list[fx.GraphModule] = []

    def recording(compile_graph: Callable[..., Any]) -> Callable[..., Any]:
        def record(graph: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
            graphs.append(graph)
            return compile_graph(graph, *args, **kwargs)

        return record

    debugging, compile_fx = torch._dynamo.backends.debugging, torch._inductor.compile_fx
    monkeypatch.setattr(debugging, "boxed_nop", recording(debugging.boxed_nop))
    monkeypatch.setattr(compile_fx, "compile_fx_inner", recording(compile_fx.compile_fx_inner))
    return graphs


def _jit_grads(layout: str, policy: str | None, backend: str, n_layers: int = 2) -> list[dict]:
    axes, make = LAYOUTS[layout]

    def rank() -> dict[str, torch.Tensor]:
        mesh = d9d.make_mesh("cpu", **axes)
        model = _model(n_layers)
        transforms = make(mesh)
        if policy is not None:
            transforms.append(d9d.remat(policy, mesh=mesh))
        step: Any = _grad_step(model)
        for transform in transforms or [d9d.shard_params(mesh, axis=None, replicate_axis="dp")]:
            step = transform(step)
        params, state = step.place(model.params, (), model=model)
        grads, _, metrics = d9d.jit(step, donate=(), backend=backend)(
            params, state, step.shard_batch(_batch())
        )
        local = {p: g.to_local() if isinstance(g, DTensor) else g for p, g in grads.items()}
        return {**local, "loss": metrics["loss"]}

    return run_on_ranks(rank, math.prod(axes.values()), timeout=600)  # inductor: minutes


@pytest.mark.compile
@pytest.mark.parametrize(
    ("layout", "policy"),
    [
        ("one device", "selective"),
        *((layout, "full") for layout in ("one device", "fsdp=2", "tp=2", "cp=2")),
    ],
)
def test_remat_under_jit_grads_bitwise_equal_no_remat(
    layout: str, policy: str, recomputed: list[fx.GraphModule]
) -> None:
    """``aot_eager`` runs the captured graph on eager kernels: the rematerialized graph's
    grads equal the eager step's without remat bit for bit, and nodes were recomputed. One
    block: what a block's recomputation is does not depend on how many there are (the next
    test counts per block), and tracing costs about a third less."""
    plain = _grads(layout, None, n_layers=1)
    for rank, (want, got) in enumerate(
        zip(plain, _jit_grads(layout, policy, "aot_eager", n_layers=1), strict=True)
    ):
        for path in want:
            assert torch.equal(want[path], got[path]), (layout, policy, rank, path)
    assert recomputed and all(_recomputed_nodes(g) > 0 for g in recomputed)


@pytest.mark.compile
@pytest.mark.usefixtures("math_attention")
def test_remat_under_inductor_equals_the_eager_step(recomputed: list[fx.GraphModule]) -> None:
    want, got = _grads("fsdp=2", None, n_layers=1), _jit_grads("fsdp=2", "full", "inductor", 1)
    for a, b in zip(want, got, strict=True):
        for path in a:
            torch.testing.assert_close(b[path], a[path], rtol=1e-9, atol=1e-12)
    assert recomputed and all(_recomputed_nodes(g) > 0 for g in recomputed)


@pytest.mark.compile
def test_jit_refuses_remat_with_microbatches_clearly() -> None:
    def rank() -> str:
        mesh = d9d.make_mesh("cpu", fsdp=1)
        model = _model(n_layers=1)
        step = d9d.shard_params(mesh, microbatches=2)(d9d.remat(mesh=mesh)(_grad_step(model)))
        params, state = step.place(model.params, ())
        with pytest.raises(PlanError, match="2 backward passes"):
            d9d.jit(step, donate=(), backend="aot_eager")(params, state, step.shard_batch(_batch()))
        return "ok"

    assert run_on_ranks(rank, 1) == ["ok"]


def _recomputed_nodes(graph: fx.GraphModule) -> int:
    return sum(node.name.endswith("_recomputed") for node in graph.graph.nodes)


def _kept_in_graph(graph: fx.GraphModule) -> int:
    """Bytes of the forward's values that the graph's backward part reads, each buffer once:
    a view or ``detach`` shares its value's memory (torch 2.11's graph reads detached aliases
    of attention's output and of the RoPE tables, one per block, where 2.13's reads the values),
    and views of the graph's inputs hold none of their own."""
    nodes = list(graph.graph.nodes)
    start = next(i for i, node in enumerate(nodes) if in_backward(node))
    order = {node: i for i, node in enumerate(nodes)}
    kept = {}
    for node in nodes[:start]:
        if not any(order[user] >= start for user in node.users):
            continue
        base = _aliased(node)
        value = base.meta.get("val")
        if base.op != "placeholder" and isinstance(value, torch.Tensor):
            kept[base] = value.numel() * value.element_size()
    return sum(kept.values())


def _aliased(node: fx.Node) -> fx.Node:
    """The node whose buffer ``node`` holds: itself unless it is a view (or detach) of one."""
    while node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            return node
        node = node.args[0]
    return node


def _lse(graph: fx.GraphModule) -> torch.Tensor:
    """One attention call's log-sum-exp as the graph records it: float64 here, but float32
    in torch 2.11, whose fake CPU flash attention gives every log-sum-exp float32."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    for node in graph.graph.nodes:
        source = node.args[0] if node.target is operator.getitem else None
        if getattr(source, "target", None) is flash and node.args[1] == 1:
            return node.meta["val"]
    raise AssertionError("no CPU flash attention in the graph")


@pytest.mark.compile
def test_remat_under_jit_keeps_block_inputs_and_attention(
    recomputed: list[fx.GraphModule],
) -> None:
    """Per block (2 blocks minus 1), the compiled graph's backward reads of the forward
    exactly the block's input and attention's outputs (out and log-sum-exp, which torch
    does not recompute: attention ops draw a seed) under full remat; more without."""
    config = LlamaConfig.tiny()
    batch, seq = _batch()["tokens"].shape
    per_block = {}
    for policy in (None, "selective", "full"):
        kept = []
        for n_layers in (1, 2):
            recomputed.clear()
            _jit_grads("one device", policy, "aot_eager", n_layers)
            kept.append(_kept_in_graph(recomputed[-1]))
        per_block[policy] = kept[1] - kept[0]
    lse = _lse(recomputed[-1])
    assert lse.shape == (batch, config.n_heads, seq)
    hidden = batch * seq * config.dim * 8
    assert per_block["full"] == 2 * hidden + lse.numel() * lse.element_size()
    assert per_block[None] > per_block["selective"] > per_block["full"]


def test_docstring_example_runs() -> None:
    module = importlib.import_module("d9d.transforms.remat._transform")
    assert doctest.testmod(module, raise_on_error=True).attempted > 0


def test_remat_checks_its_options() -> None:
    with pytest.raises(PlanError, match="not a policy"):
        d9d.remat("most")
    with pytest.raises(PlanError, match="every >= 1"):
        d9d.remat(every=0)


def kept_bytes(policy: str | None, n_layers: int, batch: int = 2, seq: int = 16) -> int:
    """Bytes of op outputs still alive after the forward (what the backward keeps)."""

    def rank() -> int:
        mesh = d9d.make_mesh("cpu", dp=1)
        model = _model(n_layers)
        transform = (
            d9d.remat(policy, mesh=mesh)
            if policy is not None
            else d9d.shard_params(mesh, axis=None, replicate_axis="dp")
        )
        fn: Any = transform(lambda p, s, t: (p, s, {}))  # placement only: the forward is below
        params, _ = fn.place(model.params, ())
        params = {p: v.detach().requires_grad_(True) for p, v in params.items()}
        skip = {v.to_local().untyped_storage().data_ptr() for v in params.values()}
        tokens = torch.randint(0, 256, (batch, seq))
        with running(fn.context()):
            with KeptBytes() as seen:
                loss = model.apply(params, tokens).sum()
            kept = seen.alive(skip)
            del loss
        return kept

    return run_on_ranks(rank, 1)[0]


def test_full_remat_keeps_only_block_inputs() -> None:
    """Per block (the difference between 4 and 2 blocks, halved), full remat keeps exactly
    the block's input [B, S, D] and nothing else; selective keeps more, no remat most."""
    dim = LlamaConfig.tiny().dim
    per_block = {}
    for policy in (None, "selective", "full"):
        per_block[policy] = (kept_bytes(policy, 4) - kept_bytes(policy, 2)) // 2
    assert per_block["full"] == 2 * 16 * dim * 8
    assert per_block[None] > per_block["selective"] > per_block["full"]


class _KeyedBlock(torch.nn.Linear):
    def forward(self, x: torch.Tensor, *, debug: bool = False, early_stop: bool = False) -> Any:
        return torch.tanh(super().forward(x)) * (2.0 if debug or early_stop else 1.0)


class _Keyed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_KeyedBlock(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor, keyword: str) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, **{keyword: True})
        return x.square().mean()


@pytest.mark.parametrize("keyword", ["debug", "early_stop"])
def test_a_block_gets_its_keywords_that_checkpoint_also_takes(keyword: str) -> None:
    """A block called with ``debug=True`` or ``early_stop=True`` gets them under remat too.
    They were passed through ``torch.utils.checkpoint``, which takes both for itself:
    ``debug=True`` failed the step ("incompatible with non-default context_fn"),
    ``early_stop=True`` reached checkpoint and not the block (loss 0.131 for 0.915, no
    error)."""
    torch.manual_seed(0)
    module = _Keyed()
    model = d9d.functionalize(module)
    x = torch.randn(3, 4)
    loss = d9d.value_and_grad(lambda p, x: model.apply(p, x, keyword))
    want = loss(model.params, x)

    def rank() -> Any:
        mesh = d9d.make_mesh("cpu", dp=1)
        step = d9d.remat("full", mesh=mesh)(lambda p, s, x: (loss(p, x), s, {}))
        params, _ = step.place(model.params, ())
        (value, grads), _, _ = step(params, (), x)
        return value, {p: g.to_local() for p, g in grads.items()}

    value, grads = run_on_ranks(rank, 1)[0]
    assert torch.equal(value, want[0])
    assert all(torch.equal(grads[p], want[1][p]) for p in want[1])
