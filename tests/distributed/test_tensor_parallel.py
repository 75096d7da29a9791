"""``tensor_parallel`` (with and without sequence parallelism, alone and with ``shard_params``)
against the same step on one device; its traffic, memory and errors."""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable

import pytest
import torch
from equivalence import (
    assert_equivalent,
    batches,
    hf_llama,
    hf_model,
    llama,
    reference,
    run,
    train_step,
)

import d9d
from d9d.errors import RankFailedError
from d9d.testing import assert_trees_all_close, run_on_ranks

pytestmark = pytest.mark.distributed

# tp=4 needs kv heads divisible by 4: 8 query heads of 8 dims, 4 kv heads (still grouped).
WIDE_HEADS = {"n_heads": 8, "n_kv_heads": 4}

LAYOUTS = {
    "tp=2": ({"tp": 2}, lambda mesh: [d9d.tensor_parallel(mesh)]),
    "tp=2 no sp": ({"tp": 2}, lambda mesh: [d9d.tensor_parallel(mesh, sequence_parallel=False)]),
    "tp=4": ({"tp": 4}, lambda mesh: [d9d.tensor_parallel(mesh)]),
    "fsdp=2 x tp=2": (
        {"fsdp": 2, "tp": 2},
        lambda mesh: [d9d.shard_params(mesh, "fsdp"), d9d.tensor_parallel(mesh)],
    ),
    "fsdp=2 x tp=2 no sp": (
        {"fsdp": 2, "tp": 2},
        lambda mesh: [
            d9d.shard_params(mesh, "fsdp"),
            d9d.tensor_parallel(mesh, sequence_parallel=False),
        ],
    ),
}


@functools.cache
def _build(model: str, dtype: torch.dtype, n_layers: int, layout: str):
    if model.startswith("hf"):
        return hf_model(model.partition(":")[2] or "llama", dtype, n_layers)
    return llama(dtype, n_layers, **(WIDE_HEADS if "tp=4" in layout else {}))


@functools.cache
def _reference(model: str, dtype: torch.dtype, n_layers: int, layout: str, opt: str):
    vocab = 97 if model.startswith("hf") else 256
    return reference(_build(model, dtype, n_layers, layout), batches(vocab), opt=opt)


def _check(
    model: str,
    layout: str,
    dtype: torch.dtype,
    *,
    jit: bool | str = False,
    n_layers: int = 2,
    opt: str = "adamw",
    params_too: bool = True,
    tol: dict[str, float] | None = None,
) -> None:
    mesh_axes, transforms = LAYOUTS[layout]
    assert_equivalent(
        _build(model, dtype, n_layers, layout),
        transforms,
        mesh_axes,
        batches(97 if model.startswith("hf") else 256),
        _reference(model, dtype, n_layers, layout, opt),
        dtype=dtype,
        jit=jit,
        opt=opt,
        params_too=params_too,
        tol=tol,
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eager_equals_one_device(layout: str) -> None:
    """float64 for AdamW params (see test_shard_params.py for why not float32)."""
    _check("d9d", layout, torch.float64)


@pytest.mark.parametrize("layout", ["tp=2", "fsdp=2 x tp=2"])
def test_hf_llama_eager_equals_one_device(layout: str) -> None:
    """From path rules alone; vocab 97 over 2 ranks is an uneven vocab shard."""
    _check("hf", layout, torch.float64)


@pytest.mark.parametrize(
    ("family", "layout"),
    [("qwen2-pad0", "tp=2"), ("qwen2-pad96", "tp=2"), ("gemma", "tp=2 no sp")],
)
def test_hf_padding_row_grads_equal_one_device(family: str, layout: str) -> None:
    """``padding_idx`` 0 (a row of rank 0: rank 1's local row 0 is global row 49, which
    must get its gradient) and 96 (local row 47 of rank 1; rank 0 holds 49 rows). Gemma
    without sequence parallelism: its norms sum their weight grads in float32, so split
    sequences round differently (rel 1e-5)."""
    _check(f"hf:{family}", layout, torch.float64)


@pytest.mark.parametrize("layout", ["tp=2 no sp", "fsdp=2 x tp=2 no sp"])
def test_hf_gpt2_equals_one_device(layout: str) -> None:
    """GPT-2's ``Conv1D`` layers whole on ``tp``, its embeddings and tied head
    vocab-parallel; without sequence parallelism (see the next test)."""
    _check("hf:gpt2", layout, torch.float64)


def test_a_region_sequence_parallelism_would_split_wrongly_is_named() -> None:
    """GPT-2 with its ``Conv1D`` layers whole: under sequence parallelism its attention
    would attend over ``S / tp`` positions, silently."""
    build = hf_model("gpt2", torch.float64, 1)

    def rank():
        mesh = d9d.make_mesh("cpu", tp=2)
        model = build()
        d9d.tensor_parallel(mesh)(lambda p, s, b: (p, s, {})).place(model.params, (), model=model)

    with pytest.raises(
        RankFailedError,
        match=r"PlanError: module 'transformer.h.0.attn' holds "
        r"'transformer.h.0.attn.c_attn.weight' whole on 'tp' and no sharded nn.Linear",
    ):
        run_on_ranks(rank, 2)


def test_a_param_the_root_module_holds_is_named_under_sequence_parallelism() -> None:
    """The runtime finds a param used before the first block (whole sequence, grad summed over
    ``tp``) by intercepting its module, which it cannot do for the root: such a param raised
    ``ValueError: a runtime cannot stand in for or intercept the root module itself``."""
    from d9d.models import Llama, LlamaConfig

    class ScaledLlama(Llama):
        def __init__(self, config: LlamaConfig) -> None:
            super().__init__(config)
            self.scale = torch.nn.Parameter(torch.ones(config.dim))

    def rank(sequence_parallel: bool) -> None:
        mesh = d9d.make_mesh("cpu", tp=2)
        module = ScaledLlama(LlamaConfig.tiny(n_layers=1))
        model = d9d.functionalize(module, axes={r"^scale$": ("embed",)})
        step = d9d.tensor_parallel(mesh, sequence_parallel=sequence_parallel)
        step(lambda p, s, b: (p, s, {})).place(model.params, (), model=model)

    with pytest.raises(
        RankFailedError,
        match=r"PlanError: params \['scale'\] are held by the model's root module "
        r"\(ScaledLlama\) itself, .* move them into a child module whose forward uses them, or "
        r"use tensor_parallel\(\.\.\., sequence_parallel=False\)",
    ):
        run_on_ranks(rank, 2, True)
    run_on_ranks(rank, 2, False)


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class _ReadsParamsDirectly(torch.nn.Module):
    """Two MLP blocks, with a learned position embedding and an output gain read as tensors
    (``self.pos.weight[:S]``), not through their modules' forwards."""

    def __init__(self, positions_before_blocks: bool) -> None:
        super().__init__()
        self.positions_before_blocks = positions_before_blocks
        self.embed = torch.nn.Embedding(97, 8)
        self.pos = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(_Block() for _ in range(2))
        self.gain = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 97, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.positions_before_blocks:
            x = x + self.pos.weight[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(x * self.gain.weight)


_DIRECT_READ_AXES = {
    r"up\.weight$": ("mlp", "embed"),
    r"up\.bias$": ("mlp",),
    r"down\.weight$": ("embed", "mlp"),
    r"down\.bias$": ("embed",),
    r"head\.weight$": ("vocab", "embed"),
    r"pos\.weight$": ("embed", "embed"),
}


def _reads_params_directly(positions_before_blocks: bool) -> Callable[[], d9d.Model]:
    """A builder of copies of one model, made here: rank threads share the RNG."""
    torch.manual_seed(0)
    module = _ReadsParamsDirectly(positions_before_blocks).to(torch.float64)
    return lambda: d9d.functionalize(copy.deepcopy(module), axes=_DIRECT_READ_AXES)


@pytest.mark.parametrize("layout", ["tp=2", "fsdp=2 x tp=2"])
def test_a_param_read_directly_before_the_first_block_is_named(layout: str) -> None:
    """The residual stream's autograd graph names a param whose module never ran before the
    first block (the position embedding's weight, sliced): its grad came out summed over the
    ``tp`` ranks, silently. The gain read the same way after the blocks is this rank's
    positions' share, summed rightly: equal to one device."""
    mesh_axes, transforms = LAYOUTS[layout]
    data = batches(97, seq_len=16, steps=2)
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: param 'pos.weight' is used before the first block, .* use "
        r"tensor_parallel\(\.\.\., sequence_parallel=False\)",
    ):
        run(_reads_params_directly(True), transforms, mesh_axes, data)
    for before in (False, True):
        build = _reads_params_directly(before)
        transforms = LAYOUTS[f"{layout} no sp"][1] if before else transforms
        assert_equivalent(
            build, transforms, mesh_axes, data, reference(build, data), dtype=torch.float64
        )


@pytest.mark.parametrize("layout", ["tp=2", "fsdp=2 x tp=2"])
def test_fp32_losses_and_sgd_params_equal_one_device(layout: str) -> None:
    _check("d9d", layout, torch.float32, params_too=False)
    _check("d9d", layout, torch.float32, opt="sgd")


@pytest.mark.compile
@pytest.mark.usefixtures("math_attention")
@pytest.mark.parametrize("layout", ["tp=2", "fsdp=2 x tp=2"])
def test_jit_equals_one_device(layout: str) -> None:
    """Inductor at ``tp=2``; the 2-D layout's graph on eager kernels (``aot_eager``): its
    capture is what it adds, and inductor on its 4 ranks cost about 2.5 min of CI."""
    _check("d9d", layout, torch.float64, jit="aot_eager" if " x " in layout else True, n_layers=1)


@pytest.mark.compile
@pytest.mark.usefixtures("math_attention")
def test_jit_hf_llama_equals_one_device() -> None:
    """The captured graph on eager kernels (``aot_eager``), at the eager test's tolerance:
    inductor's code for Hugging Face modules is tested under ``fsdp=2`` (test_shard_params.py)
    and for ``tp=2`` on d9d's Llama above; inductor here cost about 80 s of CI."""
    _check("hf", "tp=2", torch.float64, jit="aot_eager", n_layers=1)


@pytest.mark.compile
@pytest.mark.parametrize(
    ("model", "layout"),
    [("d9d", "tp=4"), ("hf", "fsdp=2 x tp=2"), ("hf:qwen2-pad96", "tp=2")],
)
def test_jit_captures_the_wider_layouts_as_one_graph(model: str, layout: str) -> None:
    """The captured forward+backward graph on eager kernels (``backend="aot_eager"``): the
    capture is what these layouts add over tp=2 (and the padding row's swap, which Dynamo
    must replay); inductor's code generation for it is tested above, and per layout would
    cost 2-3 min of CI each on two cores."""
    _check(model, layout, torch.float64, jit="aot_eager", n_layers=1)


def _comms_rank(sequence_parallel: bool, loss_parallel: bool):
    mesh = d9d.make_mesh("cpu", tp=2)
    model, opt = llama(torch.float64)(), d9d.optim.adamw(1e-3)
    tp = d9d.tensor_parallel(mesh, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    step = tp(train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params), axes=model.axes)
    return step.comms(params, state, batches(256)[0])


@pytest.mark.parametrize("loss_parallel", [True, False])
def test_sequence_parallel_moves_the_analytic_bytes(loss_parallel: bool) -> None:
    """Per block, forward: one all-gather into attention and one into the MLP, one
    reduce-scatter out of each; backward the mirror. Plus the embedding's all-reduce, the
    slice of the first block (all-gather in backward), the head's all-gather (reduce-scatter
    in backward), three all-reduces of one value per token in the loss and one all-reduce
    per norm weight's grad. Without loss parallelism the logits are all-gathered instead."""
    layers, batch, seq, dim, vocab, item = 2, 8, 16, 64, 256, 8
    act = batch * seq * dim * item
    for stats in run_on_ranks(_comms_rank, 2, True, loss_parallel):
        gathers = 4 * layers + 2
        assert stats.count[("all_gather", "tp")] == gathers + (not loss_parallel)
        assert stats.count[("reduce_scatter", "tp")] == 4 * layers + 1
        loss_reduces = 3 if loss_parallel else 0
        assert stats.count[("all_reduce", "tp")] == 1 + loss_reduces + 2 * layers + 1
        logits = 0 if loss_parallel else batch * seq * vocab * item
        assert stats.bytes[("all_gather", "tp")] == gathers * act + logits
        assert stats.bytes[("reduce_scatter", "tp")] == (4 * layers + 1) * act
        norms = (2 * layers + 1) * dim * item
        per_token = loss_reduces * batch * seq * item
        assert stats.bytes[("all_reduce", "tp")] == act + per_token + norms
        assert set(stats.count) == {
            ("all_gather", "tp"),
            ("reduce_scatter", "tp"),
            ("all_reduce", "tp"),
        }


def test_without_sequence_parallel_all_reduces_activations() -> None:
    """Megatron without SP: each attention and MLP all-reduces its output in forward and its
    input grad in backward; norm grads are complete on every rank, so not reduced."""
    layers, batch, seq, dim, item = 2, 8, 16, 64, 8
    act = batch * seq * dim * item
    for stats in run_on_ranks(_comms_rank, 2, False, True):
        # forward: embedding + 2 per block; backward: 2 per block + the head's input grad
        assert stats.count[("all_reduce", "tp")] == 1 + 2 * layers + 2 * layers + 1 + 3
        assert stats.bytes[("all_reduce", "tp")] == (4 * layers + 2) * act + 3 * batch * seq * item
        assert stats.total_count("all_gather") == stats.total_count("reduce_scatter") == 0


def test_each_rank_stores_its_share_of_every_sharded_param() -> None:
    def rank(axes: dict[str, int]):
        mesh = d9d.make_mesh("cpu", **axes)
        model, opt = llama()(), d9d.optim.adamw(1e-3)
        transforms = [d9d.tensor_parallel(mesh)]
        if "fsdp" in axes:
            transforms.append(d9d.shard_params(mesh, "fsdp"))
        step = train_step(model, opt)
        for t in transforms:
            step = t(step)
        params, state = step.place(model.params, opt.init(model.params), axes=model.axes)
        return step.memory(params, state), step.plan

    model = llama()()
    sharded = sum(p.numel() for k, p in model.params.items() if "norm" not in k) * 4
    replicated = sum(p.numel() for k, p in model.params.items() if "norm" in k) * 4
    for memory, plan in run_on_ranks(rank, 2, {"tp": 2}):
        assert memory.params == sharded // 2 + replicated
        assert 0 <= memory.opt_state - 2 * memory.params < 64  # mu, nu and step counters
        assert "tp:S(0)" in plan.table() and "tp:S(1)" in plan.table()
        assert "row-parallel" in plan.explain("layers.0.attn.wo.weight")
    for memory, _ in run_on_ranks(rank, 4, {"fsdp": 2, "tp": 2}):
        assert memory.params == sharded // 4 + replicated // 2  # norms: sharded on fsdp only


def test_decorator_order_does_not_change_the_plan() -> None:
    def rank():
        mesh = d9d.make_mesh("cpu", fsdp=2, tp=2)
        model = llama()()
        fn = train_step(model, d9d.optim.sgd(0.1))
        a = d9d.shard_params(mesh)(d9d.tensor_parallel(mesh)(fn))
        b = d9d.tensor_parallel(mesh)(d9d.shard_params(mesh)(fn))
        plans = [s.make_plan(model.params, model.axes) for s in (a, b)]
        return [{k: (e.storage, e.compute, e.grad) for k, e in p.entries.items()} for p in plans]

    for first, second in run_on_ranks(rank, 4):
        assert first == second
        assert first["layers.0.attn.wq.weight"][0] == (
            torch.distributed.tensor.Shard(1),
            torch.distributed.tensor.Shard(0),
        )


def test_heads_that_do_not_divide_over_tp_are_named() -> None:
    def rank():
        mesh = d9d.make_mesh("cpu", tp=4)
        model = llama()()  # 2 kv heads
        step = d9d.tensor_parallel(mesh)(train_step(model, d9d.optim.sgd(0.1)))
        params, state = step.place(model.params, (), axes=model.axes)
        step(params, state, batches(256)[0])

    with pytest.raises(
        RankFailedError, match=r"IndivisibleError: n_kv_heads=2 does not divide over 4 'tp'"
    ):
        run_on_ranks(rank, 4)


def test_a_sequence_that_does_not_divide_is_named() -> None:
    def rank():
        mesh = d9d.make_mesh("cpu", tp=2)
        model = llama()()
        step = d9d.tensor_parallel(mesh)(train_step(model, d9d.optim.sgd(0.1)))
        params, state = step.place(model.params, (), axes=model.axes)
        batch = batches(256, seq_len=15)[0]
        step(params, state, batch)

    with pytest.raises(
        RankFailedError, match=r"IndivisibleError: .*activations \(8, 15, 64\) over 2 'tp' ranks"
    ):
        run_on_ranks(rank, 2)


def test_a_param_without_a_rule_is_named() -> None:
    """A linear given the default axes ("out", "in"), which tensor parallelism has no rule
    for."""

    build = hf_llama()  # built here: two threads importing transformers' lazy names race

    def rank():
        mesh = d9d.make_mesh("cpu", tp=2)
        model = d9d.functionalize(build().module, axes={r"q_proj\.weight$": ("out", "in")})
        d9d.tensor_parallel(mesh)(lambda p, s, b: (p, s, {})).make_plan(model.params, model.axes)

    with pytest.raises(
        RankFailedError,
        match=r"param 'model.layers.0.self_attn.q_proj.weight' \(shape \(48, 48\)\) has "
        r"nn.Linear's default axes \('out', 'in'\): .* To keep it whole on every tp rank .*"
        r"pass d9d.functionalize\(module, axes=\{r'\\.q_proj\\.weight\$': "
        r"\('embed', 'embed'\)\}\)",
    ):
        run_on_ranks(rank, 2)


def test_a_hugging_face_model_is_placeable_by_its_family_rules() -> None:
    def rank():
        mesh = d9d.make_mesh("cpu", tp=2)
        model = d9d.functionalize(hf_llama()().module)
        step = d9d.tensor_parallel(mesh)(lambda p, s, b: (p, s, {}))
        return step.make_plan(model.params, model.axes)

    plan = run_on_ranks(rank, 2)[0]
    assert "uneven" in plan.explain("lm_head.weight")
    assert plan.bytes_per_rank() < plan.total_bytes() * 0.6


def test_large_plan_on_a_simulated_mesh() -> None:
    """The 8b preset on 64 fake ranks (fsdp=8 x tp=8): every sharded param is 1/64 per rank."""
    from d9d.models import Llama, LlamaConfig
    from d9d.testing import fake_world

    with fake_world(64), torch.device("meta"):
        mesh = d9d.make_mesh("cpu", fsdp=8, tp=8)
        model = d9d.functionalize(Llama(LlamaConfig.llama_8b()))
        step = d9d.tensor_parallel(mesh)(d9d.shard_params(mesh)(lambda p, s, b: (p, s, {})))
        plan = step.make_plan(model.params, model.axes)
    norms = sum(math.prod(e.shape) * 4 for k, e in plan.entries.items() if "norm" in k)
    assert plan.bytes_per_rank() == (plan.total_bytes() - norms) // 64 + norms // 8


def test_an_embedding_option_a_vocab_shard_cannot_honour_is_named() -> None:
    def rank():
        mesh = d9d.make_mesh("cpu", tp=2)
        module = torch.nn.Sequential(torch.nn.Embedding(16, 8, max_norm=1.0))
        model = d9d.functionalize(module)
        step = d9d.tensor_parallel(mesh)(lambda p, s, b: (p, s, model.apply(p, b)))
        params, state = step.place(model.params, (), model=model)
        step(params, state, torch.zeros(2, 4, dtype=torch.long))

    with pytest.raises(RankFailedError, match=r"PlanError: embedding '0' has max_norm=1.0"):
        run_on_ranks(rank, 2)


class _NormedEmbedding(torch.nn.Embedding):
    """An embedding whose forward normalizes the lookup with a weight of its own (Inkling's)."""

    def __init__(self) -> None:
        super().__init__(16, 8)
        self.norm = torch.nn.RMSNorm(8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(ids))


def test_an_embedding_with_params_besides_its_weight_is_refused_by_name() -> None:
    def rank():
        mesh = d9d.make_mesh("cpu", tp=2)
        model = d9d.functionalize(
            torch.nn.Sequential(_NormedEmbedding()), axes={"norm": ("embed",)}
        )
        step = d9d.tensor_parallel(mesh)(lambda p, s, b: (p, s, {}))
        step.place(model.params, (), model=model)

    with pytest.raises(
        RankFailedError,
        match=r"PlanError: embedding '0' \(_NormedEmbedding\) holds params besides its weight "
        r"\(\['norm.weight'\]\).* axes=\{'0\\\\.weight\$': \('embed', 'embed'\)\}",
    ):
        run_on_ranks(rank, 2)


def _hf_own_loss_rank(build, loss_parallel: bool):
    """Loss and grads of ``model.apply(p, input_ids=x, labels=x).loss`` (the Hugging Face
    way) under tp=2, gathered whole."""
    mesh = d9d.make_mesh("cpu", tp=2)
    model = build()

    def step(params, opt_state, batch):
        def loss_fn(p):
            return model.apply(p, input_ids=batch["tokens"], labels=batch["tokens"]).loss

        loss, grads = d9d.value_and_grad(loss_fn)(params)
        return params, opt_state, {"loss": loss, "grads": grads}

    step = d9d.tensor_parallel(mesh, loss_parallel=loss_parallel)(step)
    params, state = step.place(model.params, (), model=model)
    metrics = step(params, state, batches(97)[0])[2]
    return metrics["loss"], {k: g.full_tensor() for k, g in metrics["grads"].items()}


def test_hf_own_loss_with_vocab_sharded_logits_is_named() -> None:
    """``F.cross_entropy`` inside transformers cannot take the head's DTensor logits."""
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: Model.apply got labels=.*'lm_head'.*d9d.losses.cross_entropy"
        r".*loss_parallel=False",
    ):
        run_on_ranks(_hf_own_loss_rank, 2, hf_llama(torch.float64), True)


def test_hf_own_loss_without_loss_parallel_equals_one_device() -> None:
    """transformers computes its loss in float32 (``logits.float()``), so float32 tolerances."""
    build, tokens = hf_llama(torch.float64), batches(97)[0]["tokens"]
    model = build()
    loss, grads = d9d.value_and_grad(
        lambda p: model.apply(p, input_ids=tokens, labels=tokens).loss
    )(model.params)
    for got_loss, got_grads in run_on_ranks(_hf_own_loss_rank, 2, build, False):
        torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=1e-7)
        assert_trees_all_close(got_grads, grads, rtol=1e-5, atol=1e-7)


GPT2_SHARDED = {  # what the Llama rules suggest for GPT-2's Conv1D ([in, out]) layers
    r"c_attn\.weight$": ("embed", "heads"),
    r"c_attn\.bias$": ("heads",),
    r"attn\.c_proj\.weight$": ("heads", "embed"),
    r"c_fc\.weight$": ("embed", "mlp"),
    r"c_fc\.bias$": ("mlp",),
    r"mlp\.c_proj\.weight$": ("mlp", "embed"),
    r"c_proj\.bias$": ("embed",),
}


@pytest.mark.parametrize("at", ["place", "call"])
def test_a_sharded_param_of_a_module_tensor_parallel_does_not_know_is_named(at: str) -> None:
    """GPT-2's fused q/k/v ``Conv1D``: a row range of it is not a group of heads. Named at
    ``place`` when it gets the model, else at the call, before any collective."""
    module = hf_model("gpt2", torch.float64, 1)().module

    def rank():
        mesh = d9d.make_mesh("cpu", tp=2)
        model = d9d.functionalize(copy.deepcopy(module), axes=GPT2_SHARDED)
        step = d9d.tensor_parallel(mesh, sequence_parallel=False)(
            train_step(model, opt := d9d.optim.sgd(0.1))
        )
        known = {"model": model} if at == "place" else {"axes": model.axes}
        params, state = step.place(model.params, opt.init(model.params), **known)
        step(params, state, batches(97)[0])

    with pytest.raises(
        RankFailedError,
        match=r"PlanError: param 'transformer.h.0.attn.c_attn.weight' is sharded over 'tp' "
        r"\(dim 1, logical axis 'heads'\), but its module 'transformer.h.0.attn.c_attn' "
        r"\(Conv1D\) is not one tensor_parallel knows",
    ):
        run_on_ranks(rank, 2)


def test_a_forward_that_raises_leaves_the_module_as_it_was() -> None:
    """The hooks swap a vocab shard's padding row and a row-parallel bias in and out; a
    forward that raises in between must not leave them swapped."""
    build = hf_model("qwen2-pad96", torch.float64, 1)

    def rank():
        mesh = d9d.make_mesh("cpu", tp=2)
        model = build()
        embedding = model.module.model.embed_tokens

        def fail(*_):
            raise RuntimeError("out of memory")

        handle = embedding.register_forward_pre_hook(fail)
        step = d9d.tensor_parallel(mesh)(train_step(model, opt := d9d.optim.sgd(0.1)))
        params, state = step.place(model.params, opt.init(model.params), model=model)
        with pytest.raises(RuntimeError, match="out of memory"):
            step(params, state, batches(97)[0])
        handle.remove()
        return embedding.padding_idx

    assert run_on_ranks(rank, 2) == [96, 96]


class _TokenPositions(torch.nn.Embedding):
    """BART's learned positions: given the tokens, of which it reads only the length."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.arange(tokens.shape[1], device=tokens.device) + 2)


class _ScaledEmbedding(torch.nn.Embedding):
    """Gemma's token embedding: the lookup times a scale."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 3.0


class _PositionsModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = _ScaledEmbedding(16, 8, padding_idx=11)
        self.positions = _TokenPositions(24, 8)  # rows 2..9 read: all on rank 0's half

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.tokens(tokens) + self.positions(tokens)).square().mean(-1)


def _positions_rank(module: torch.nn.Module, tokens: torch.Tensor):
    mesh = d9d.make_mesh("cpu", tp=2)
    model = d9d.functionalize(copy.deepcopy(module))

    def step(params, opt_state, batch):
        loss, grads = d9d.value_and_grad(lambda p: model.apply(p, batch).sum())(params)
        return params, opt_state, {"loss": loss, "grads": grads}

    step = d9d.tensor_parallel(mesh)(step)
    params, state = step.place(model.params, (), model=model)
    assert params["positions.weight"].placements == (torch.distributed.tensor.Shard(0),)
    metrics = step(params, state, tokens)[2]
    return metrics["loss"], {k: g.full_tensor() for k, g in metrics["grads"].items()}


def test_an_embedding_whose_forward_computes_its_ids_is_looked_up_at_its_table() -> None:
    """The vocab-parallel lookup remapped the first argument: positions computed from the
    tokens' length were looked up in each rank's own rows (rank 1 read global rows 14..21
    for 2..9), wrong with no error. The padding row (11, on rank 1) gets no grad."""
    torch.manual_seed(0)
    module = _PositionsModel()
    tokens = torch.tensor([[3, 11, 15, 0, 7, 11, 2, 9], [1, 4, 11, 12, 8, 6, 5, 10]])
    model = d9d.functionalize(module)
    loss, grads = d9d.value_and_grad(lambda p: model.apply(p, tokens).sum())(model.params)
    assert grads["tokens.weight"][11].abs().sum() == 0
    for got_loss, got_grads in run_on_ranks(_positions_rank, 2, module, tokens):
        torch.testing.assert_close(got_loss, loss)
        assert_trees_all_close(got_grads, grads)
