from __future__ import annotations

import copy
import re
from typing import ClassVar

import pytest
import torch
from torch import nn

import d9d
from d9d.errors import ParamShapeError, ParamTreeMismatchError, PlanError
from d9d.models import Llama, LlamaConfig
from d9d.testing import assert_trees_all_close


def _hf_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=100,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


_HF_AXES = {
    r"q_proj\.weight$": ("heads", "embed"),
    r"[kv]_proj\.weight$": ("kv_heads", "embed"),
    r"o_proj\.weight$": ("embed", "heads"),
    r"(gate|up)_proj\.weight$": ("mlp", "embed"),
    r"down_proj\.weight$": ("embed", "mlp"),
    r"lm_head\.weight$": ("vocab", "embed"),
}


def _module_grads(module: nn.Module, loss_fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    module.zero_grad()
    loss = loss_fn(module)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in module.named_parameters()}


def test_hf_llama_apply_and_grads_match_module_backward() -> None:
    module = _hf_llama()
    model = d9d.functionalize(module, axes=_HF_AXES)
    tokens = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, dims=1)

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    expected_loss, expected_grads = _module_grads(module, lambda m: loss_of(m(tokens).logits))
    loss, grads = d9d.value_and_grad(lambda p: loss_of(model.apply(p, tokens).logits))(model.params)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    assert_trees_all_close(grads, expected_grads, rtol=1e-6, atol=1e-6)
    assert model.axes["model.layers.1.self_attn.k_proj.weight"] == ("kv_heads", "embed")
    assert model.axes["model.embed_tokens.weight"] == ("vocab", "embed")
    assert model.axes["model.norm.weight"] == ("embed",)  # an *RMSNorm, by d9d.hf


def test_apply_is_pure_and_leaves_module_untouched() -> None:
    module = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    model = d9d.functionalize(module)
    other = {k: torch.randn_like(v) for k, v in model.params.items()}
    x = torch.randn(5, 3)
    first = model.apply(other, x)
    torch.testing.assert_close(model.apply(other, x), first, rtol=0, atol=0)
    for k, v in module.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(isinstance(p, nn.Parameter) for p in module.parameters())


def test_tied_weights_appear_once_and_are_used_in_both_places() -> None:
    module = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7, bias=False))
    module[1].weight = module[0].weight
    model = d9d.functionalize(module)
    assert list(model.params) == ["0.weight"]
    assert model.tied == {"1.weight": "0.weight"}
    tokens = torch.tensor([[1, 2, 3]])
    _, expected = _module_grads(module, lambda m: m(tokens).logsumexp(-1).sum())
    grads = d9d.grad(lambda p: model.apply(p, tokens).logsumexp(-1).sum())(model.params)
    torch.testing.assert_close(grads["0.weight"], expected["0.weight"])


def test_declared_logical_axes_are_relative_and_deepest_first() -> None:
    class Block(nn.Module):
        logical_axes: ClassVar = {r"^proj\.weight$": ("mlp", "embed")}

        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 6)
            self.scale = nn.Parameter(torch.ones(6))

    class Net(nn.Module):
        logical_axes: ClassVar = {r"proj\.weight$": ("heads", "embed"), r"scale$": ("mlp",)}

        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

    model = d9d.functionalize(Net())
    assert model.axes == {
        "block.proj.weight": ("mlp", "embed"),
        "block.proj.bias": ("out",),
        "block.scale": ("mlp",),
    }
    user = d9d.functionalize(Net(), axes={r"block\.proj\.weight": ("a", "b")})
    assert user.axes["block.proj.weight"] == ("a", "b")


def test_position_wise_modules_are_those_declaring_it_outermost_first() -> None:
    class Mixer(nn.Module):
        def __init__(self, position_wise: bool) -> None:
            super().__init__()
            self.position_wise = position_wise  # per instance
            self.inner = Inner()

    class Inner(nn.Module):
        position_wise: ClassVar = True  # per class

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Mixer(True), Mixer(False)])

    structure = d9d.functionalize(Net()).structure
    assert structure.position_wise == ("layers.0", "layers.0.inner", "layers.1.inner")
    assert d9d.functionalize(nn.Linear(2, 2)).structure.position_wise == ()


def test_buffers_are_passed_and_restored() -> None:
    class Shift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))
            self.register_buffer("offset", torch.full((2,), 3.0), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w + self.offset

    model = d9d.functionalize(Shift())
    assert list(model.buffers) == ["offset"]
    assert model.axes == {"w": (None,)}
    torch.testing.assert_close(
        model.apply({"w": torch.full((2,), 2.0)}, torch.ones(2)), torch.full((2,), 5.0)
    )


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


def test_a_forward_that_writes_a_buffer_is_named_alone_and_in_a_step() -> None:
    """BatchNorm in training mode updates its running statistics in place: state no step
    returns, no rank shares and no checkpoint saves. Refused by the buffer's path; in eval
    mode it reads them only and runs."""
    from d9d.testing import run_on_ranks

    module = _Normed()
    model = d9d.functionalize(module)
    match = re.escape("wrote its buffers ['norm.num_batches_tracked'] in place")
    with pytest.raises(ValueError, match=match):
        model.apply(model.params, torch.randn(6, 4))

    def rank() -> None:
        own = copy.deepcopy(model)  # a module per thread rank
        mesh = d9d.make_mesh("cpu", fsdp=2)
        loss = d9d.value_and_grad(lambda p, x: own.apply(p, x).square().mean())
        step = d9d.shard_params(mesh)(lambda p, s, x: (p, s, loss(p, x)[0]))
        params, _ = step.place(own.params, ())
        with pytest.raises(ValueError, match=match):
            step(params, (), torch.randn(6, 4))

    run_on_ranks(rank, 2)
    module.eval()
    assert model.apply(model.params, torch.randn(6, 4)).shape == (6, 4)


def test_mismatched_params_name_missing_and_unexpected_paths() -> None:
    model = d9d.functionalize(nn.Linear(3, 2))
    with pytest.raises(
        ParamTreeMismatchError, match=r"missing paths \['bias'\], unexpected paths \['bais'\]"
    ):
        model.apply({"weight": model.params["weight"], "bais": model.params["bias"]}, torch.ones(3))


@pytest.mark.parametrize(
    ("build", "path"),
    [
        (lambda: d9d.functionalize(Llama(LlamaConfig.tiny())), "layers.1.mlp.w_up.weight"),
        (lambda: d9d.functionalize(_hf_llama()), "model.layers.1.mlp.up_proj.weight"),
    ],
    ids=["d9d", "hf"],
)
def test_param_of_wrong_shape_names_its_path_and_both_shapes(build, path: str) -> None:
    model = build()
    rows, cols = model.params[path].shape
    params = {**model.params, path: torch.zeros(rows, cols + 1)}
    with pytest.raises(
        ParamShapeError,
        match=rf"param '{re.escape(path)}' has shape \({rows}, {cols + 1}\) but the model's is "
        rf"\({rows}, {cols}\); pass params built for this model",
    ):
        model.apply(params, torch.zeros(1, 4, dtype=torch.long))


def test_axes_rule_of_wrong_rank_names_the_param() -> None:
    with pytest.raises(ValueError, match=r"param 'weight' has shape \(2, 3\)"):
        d9d.functionalize(nn.Linear(3, 2), axes={"weight": ("embed",)})


def test_axes_pattern_matching_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"axes patterns \['q_proj'\] match no param"):
        d9d.functionalize(nn.Linear(3, 2), axes={"q_proj": ("heads", "embed")})


def _hook_counts(module: torch.nn.Module) -> list[int]:
    return [
        len(getattr(m, name))
        for m in module.modules()
        for name in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_state_dict_hooks",
            "_load_state_dict_pre_hooks",
        )
    ]


def test_functionalize_and_placed_apply_leave_the_module_untouched() -> None:
    """No hooks and no swapped classes or modules, after functionalize and after a
    transformed step ran the model (its runtimes intercept modules only during a call)."""
    from d9d.models import Llama, LlamaConfig
    from d9d.testing import run_on_ranks

    def rank() -> None:
        module = Llama(LlamaConfig.tiny(n_layers=2))
        before = [(path, type(m), id(m)) for path, m in module.named_modules()]
        hooks = _hook_counts(module)
        model = d9d.functionalize(module)
        assert _hook_counts(module) == hooks == [0] * len(hooks)
        mesh = d9d.make_mesh("cpu", fsdp=1, tp=2)
        loss = d9d.value_and_grad(lambda p, t: model.apply(p, t).float().mean())
        step = d9d.shard_params(mesh)(
            d9d.tensor_parallel(mesh)(lambda p, s, t: (p, s, loss(p, t)[0]))
        )
        params, _ = step.place(model.params, (), model=model)
        step(params, (), torch.zeros(2, 8, dtype=torch.long))
        assert [(path, type(m), id(m)) for path, m in module.named_modules()] == before
        assert _hook_counts(module) == hooks

    run_on_ranks(rank, 2)


def test_a_deep_copy_is_a_model_of_its_own_module() -> None:
    """``copy.deepcopy`` of a model (as a rank thread takes its own from one built once):
    its structure is read from the copied module; a field-by-field copy kept the original's
    module ids, and the first step failed with a bare ``KeyError`` of one."""
    import copy

    from d9d.testing import run_on_ranks

    torch.manual_seed(0)
    model = d9d.functionalize(Llama(LlamaConfig.tiny(tie_embeddings=True)), axes={})
    tokens = torch.randint(0, 256, (4, 9))

    def loss(step_model: d9d.Model) -> torch.Tensor:
        mesh = d9d.make_mesh("cpu", fsdp=2)

        @d9d.shard_params(mesh, "fsdp")
        def step(params, opt_state, batch):
            logits = step_model.apply(params, batch[:, :-1])
            return params, opt_state, {"loss": d9d.losses.cross_entropy(logits, batch[:, 1:])}

        params, state = step.place(step_model.params, (), model=step_model)
        return step(params, state, step.shard_batch(tokens))[2]["loss"]

    twin = copy.deepcopy(model)
    assert twin.axes == model.axes and twin.tied == model.tied
    assert twin.params.keys() == model.params.keys()
    assert all(twin.params[p] is not model.params[p] for p in model.params)
    logits = model.apply(model.params, tokens[:, :-1])
    expected = d9d.losses.cross_entropy(logits, tokens[:, 1:])
    for got in run_on_ranks(lambda: loss(copy.deepcopy(model)), 2):
        torch.testing.assert_close(got, expected)


class _PartlyFrozen(nn.Module):
    """A frozen scale at the root and a frozen linear in block 0 of two."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((4,), 1.5), requires_grad=False)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.layers[0].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x * self.scale))
        return x


@pytest.mark.parametrize("shard", ["params", "opt_state"])
def test_a_param_built_without_grad_gets_a_zero_grad_alone_and_in_a_step(shard: str) -> None:
    """A param with ``requires_grad=False`` (frozen) gets no grad through ``apply``, as in
    torch: ``value_and_grad`` gives it zeros, so a masked optimizer leaves it as it is and it
    adds nothing to a global grad norm. Every param used to be differentiated alike: the
    frozen ones got their full grads (sums of |grad| 0.21 to 1.25 here), which the optimizer
    applied and clipping counted."""
    from d9d.testing import run_on_ranks

    torch.manual_seed(0)
    module = _PartlyFrozen().double()
    model = d9d.functionalize(module)
    x = torch.randn(6, 4, dtype=torch.float64)
    module(x).square().mean().backward()
    want = {p: t.grad for p, t in module.named_parameters()}
    frozen = {"scale", "layers.0.weight", "layers.0.bias"}
    assert {p for p, g in want.items() if g is None} == frozen
    loss = d9d.value_and_grad(lambda p, x: model.apply(p, x).square().mean())
    grads = loss(model.params, x)[1]
    for path, grad in grads.items():
        torch.testing.assert_close(grad, torch.zeros_like(grad) if path in frozen else want[path])

    def rank() -> dict[str, torch.Tensor]:
        own = copy.deepcopy(model)  # a module per thread rank
        mesh = d9d.make_mesh("cpu", fsdp=2)
        grad_of = d9d.value_and_grad(lambda p, x: own.apply(p, x).square().mean())

        @d9d.shard_params(mesh, shard=shard)
        @d9d.remat("full", mesh=mesh)
        def step(params, opt_state, batch):
            return grad_of(params, batch)[1], opt_state, {}

        params, _ = step.place(own.params, ())
        out = step(params, (), step.shard_batch(x))[0]
        return {p: g.full_tensor() for p, g in out.items()}

    for got in run_on_ranks(rank, 2):
        for path, grad in got.items():
            torch.testing.assert_close(grad, grads[path])


class _SharedBlock(nn.Module):
    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.own = nn.Linear(4, 4)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(torch.tanh(self.own(x))))


class _SharedAcrossBlocks(nn.Module):
    """One linear used by both blocks, registered at the root first (``first="root"``) or in
    the blocks first and used around them too (``first="blocks"``)."""

    def __init__(self, first: str) -> None:
        super().__init__()
        shared = nn.Linear(4, 4)
        if first == "root":
            self.shared = shared
        self.layers = nn.ModuleList(_SharedBlock(shared) for _ in range(2))
        if first == "blocks":
            self.shared = shared
        self.first = first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first == "blocks":
            x = self.shared(x)
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.mark.parametrize("first", ["root", "blocks"])
@pytest.mark.parametrize("policy", [None, "full"])
def test_a_module_shared_between_blocks_computes_with_the_given_params(
    first: str, policy: str | None
) -> None:
    """A module that two blocks share is gathered into its slots for each of them (and for
    the code around the blocks that uses it), and recomputed by ``remat`` with them. Its
    slots belonged to the last block only, so in a step the first block computed with the
    module's own weights, not the params given (loss 0.0914 for 0.0906, grads 0.031 off);
    one registered in the blocks first kept the step's tensors only around the blocks, and a
    recomputed block read the module's own (grads 0.0136 off under remat("full"))."""
    from d9d.testing import run_on_ranks

    torch.manual_seed(0)
    model = d9d.functionalize(_SharedAcrossBlocks(first).double())
    params = {p: t * 1.3 + 0.05 for p, t in model.params.items()}  # not the module's own
    x = torch.randn(4, 4, dtype=torch.float64)
    grad_of = d9d.value_and_grad(lambda p, x, m=model: m.apply(p, x))
    want = grad_of(params, x)

    def rank() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        own = copy.deepcopy(model)
        mesh = d9d.make_mesh("cpu", dp=1)
        transform = (
            d9d.remat(policy, mesh=mesh)
            if policy
            else d9d.shard_params(mesh, axis=None, replicate_axis="dp")
        )
        grads = d9d.value_and_grad(lambda p, x: own.apply(p, x))
        step = transform(lambda p, s, x: (grads(p, x), s, {}))
        placed, _ = step.place(params, (), model=own)
        (value, got), _, _ = step(placed, (), x)
        return value, {p: g.to_local() for p, g in got.items()}

    value, grads = run_on_ranks(rank, 1)[0]
    torch.testing.assert_close(value, want[0])
    for path, grad in grads.items():
        torch.testing.assert_close(grad, want[1][path])


@pytest.mark.parametrize("first", ["root", "blocks"])
def test_pipeline_refuses_a_module_shared_between_stages_by_name(first: str) -> None:
    """Each stage would train a copy of its own (its slots went to the last block only)."""
    from d9d.testing import run_on_ranks

    model = d9d.functionalize(_SharedAcrossBlocks(first))

    def rank() -> None:
        mesh = d9d.make_mesh("cpu", pp=2)
        grads = d9d.value_and_grad(lambda p, x: model.apply(p, x))
        step = d9d.pipeline(mesh, microbatches=1)(lambda p, s, x: (grads(p, x)[1], s, {}))
        match = (
            r"pipeline cannot place param '(layers\.0\.)?shared\.weight': block 'layers\.0' of "
            r"stage 0 and a "
            r"module outside the blocks both hold it .* share it only within the blocks of "
            r"one stage"
        )
        with pytest.raises(PlanError, match=match):
            step.place(model.params, (), model=model)

    run_on_ranks(rank, 2, method="fork")
