"""Llama: param layout, logical axes, deterministic init, meta construction, forward checks."""

from __future__ import annotations

import doctest
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import d9d
from d9d.models import Llama, LlamaConfig
from d9d.models.llama import _model

TINY = LlamaConfig.tiny()


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def test_docstring_examples_run() -> None:
    assert doctest.testmod(_model, extraglobs={"LlamaConfig": LlamaConfig}).failed == 0


def test_param_paths_and_shapes() -> None:
    shapes = {k: tuple(v.shape) for k, v in _params(Llama(TINY)).items()}
    assert shapes["embed.weight"] == (256, 64)
    assert shapes["layers.1.attn.wq.weight"] == (64, 64)
    assert shapes["layers.1.attn.wk.weight"] == shapes["layers.1.attn.wv.weight"] == (32, 64)
    assert shapes["layers.1.attn.wo.weight"] == (64, 64)
    assert shapes["layers.0.mlp.w_gate.weight"] == shapes["layers.0.mlp.w_up.weight"] == (176, 64)
    assert shapes["layers.0.mlp.w_down.weight"] == (64, 176)
    assert shapes["layers.0.attn_norm.weight"] == shapes["layers.0.mlp_norm.weight"] == (64,)
    assert shapes["norm.weight"] == (64,)
    assert shapes["head.weight"] == (256, 64)
    assert len(shapes) == 3 + 9 * TINY.n_layers
    assert list(Llama(TINY).buffers()) == []


@pytest.mark.parametrize("preset", ["tiny", "small", "1b", "8b"])
def test_every_param_matches_exactly_one_logical_axes_rule(preset: str) -> None:
    model = Llama(LlamaConfig.preset(preset), device="meta")
    for path, param in model.named_parameters():
        rules = [axes for rx, axes in Llama.logical_axes.items() if re.search(rx, path)]
        assert len(rules) == 1, (path, rules)
        assert len(rules[0]) == param.dim(), (path, rules[0], param.shape)
    assert dict(Llama.logical_axes.items()) == model.logical_axes


def test_functionalize_uses_the_declared_axes() -> None:
    model = d9d.functionalize(Llama(LlamaConfig.tiny(tie_embeddings=True)))
    assert model.tied == {"head.weight": "embed.weight"}
    for path, axes in model.axes.items():
        assert axes == next(a for rx, a in Llama.logical_axes.items() if re.search(rx, path))


def test_logical_axes_of_projections() -> None:
    def axes_of(path: str) -> tuple[str | None, ...]:
        return next(a for rx, a in Llama.logical_axes.items() if re.search(rx, path))

    assert axes_of("embed.weight") == axes_of("head.weight") == ("vocab", "embed")
    assert axes_of("layers.3.attn.wq.weight") == ("heads", "embed")
    assert axes_of("layers.3.attn.wv.weight") == ("kv_heads", "embed")
    assert axes_of("layers.3.attn.wo.weight") == ("embed", "heads")
    assert axes_of("layers.3.mlp.w_up.weight") == ("mlp", "embed")
    assert axes_of("layers.3.mlp.w_down.weight") == ("embed", "mlp")
    assert axes_of("norm.weight") == axes_of("layers.3.mlp_norm.weight") == ("embed",)


@pytest.mark.parametrize("via_meta", [False, True])
def test_tied_head_is_the_embedding(via_meta: bool) -> None:
    model = Llama(LlamaConfig.tiny(tie_embeddings=True), device="meta" if via_meta else None)
    if via_meta:
        model.to_empty(device="cpu").init_weights()
    params = _params(model)
    assert "head.weight" not in params
    assert model.head.weight is model.embed.weight
    assert sum(p.numel() for p in params.values()) == model.config.num_params
    hidden = {}
    model.norm.register_forward_hook(lambda mod, args, out: hidden.setdefault("h", out))
    tokens = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    torch.testing.assert_close(logits, F.linear(hidden["h"], params["embed.weight"]))


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_num_params_matches_module(preset: str) -> None:
    cfg = LlamaConfig.preset(preset)
    model = Llama(cfg, device="meta")
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params
    block = sum(p.numel() for p in model.layers[0].parameters())
    assert block == cfg.num_block_params


def test_init_is_deterministic_and_ignores_global_rng() -> None:
    torch.manual_seed(1)
    rng = torch.get_rng_state()
    a = _params(Llama(TINY))
    assert torch.equal(torch.get_rng_state(), rng)  # construction leaves the global RNG alone
    torch.manual_seed(2)
    torch.randn(100)
    b = _params(Llama(TINY))
    c = _params(Llama(LlamaConfig.tiny(seed=1)))
    for path in a:
        assert torch.equal(a[path], b[path]), path
        if not path.endswith("norm.weight"):
            assert not torch.equal(a[path], c[path]), path


def test_init_depends_only_on_seed_and_path() -> None:
    two = _params(Llama(TINY))
    one = _params(Llama(LlamaConfig.tiny(n_layers=1)))
    for path in (
        "embed.weight",
        "head.weight",
        "layers.0.attn.wq.weight",
        "layers.0.mlp.w_up.weight",
    ):
        assert torch.equal(one[path], two[path]), path
    assert not torch.equal(two["layers.0.attn.wq.weight"], two["layers.1.attn.wq.weight"])


def test_init_distribution() -> None:
    cfg = LlamaConfig.small(init_std=0.05)
    model = Llama(cfg)
    params = _params(model)
    residual = 0.05 / (2 * cfg.n_layers) ** 0.5
    for path, std in [
        ("embed.weight", 0.05),
        ("layers.2.attn.wq.weight", 0.05),
        ("layers.2.mlp.w_gate.weight", 0.05),
        ("layers.2.attn.wo.weight", residual),
        ("layers.2.mlp.w_down.weight", residual),
    ]:
        assert params[path].std().item() == pytest.approx(std, rel=0.02), path
        assert params[path].mean().item() == pytest.approx(0.0, abs=0.05 * std), path
    assert all(params[p].eq(1).all() for p in params if p.endswith("norm.weight"))


class _OutputDevices(TorchDispatchMode):
    """The device types of every tensor an op returns inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.types: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in out if isinstance(out, tuple | list) else (out,):
            if isinstance(leaf, torch.Tensor):
                self.types.add(leaf.device.type)
        return out


def test_meta_construction_of_8b_allocates_nothing() -> None:
    with torch.device("meta"), _OutputDevices() as made:
        model = Llama(LlamaConfig.preset("8b"))
    assert made.types == {"meta"}  # no op made a tensor with data, however small
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    model_1b = Llama(LlamaConfig.llama_1b(), device="meta")
    assert sum(p.numel() for p in model_1b.parameters()) == 1_235_814_400


def test_to_empty_then_init_weights_equals_eager_construction() -> None:
    expected = _params(Llama(TINY))
    model = Llama(TINY, device="meta").to_empty(device="cpu")
    model.init_weights()
    got = _params(model)
    for path in expected:
        assert torch.equal(got[path], expected[path]), path
    model.init_weights(seed=5)
    assert not torch.equal(_params(model)["embed.weight"], expected["embed.weight"])


def test_gradients_reach_every_param() -> None:
    model = Llama(TINY)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    model(tokens).square().mean().backward()
    for path, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, path


def test_forward_is_causal() -> None:
    model = Llama(TINY)
    tokens = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 6] = (changed[0, 6] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=0, rtol=0)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_default_positions_are_arange() -> None:
    model = Llama(TINY)
    tokens = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), model(tokens, torch.arange(7)), atol=0, rtol=0)
        assert not torch.allclose(model(tokens), model(tokens, torch.arange(7) + 50))


def test_bf16_forward_close_to_fp32() -> None:
    model = Llama(TINY)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(tokens)
        got = model.to(torch.bfloat16)(tokens)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.compile  # aot_eager: checks tracing without inductor codegen (~2 s)
def test_compiles_fullgraph_forward_and_backward() -> None:
    model = Llama(TINY)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = model(tokens)
    expected.sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    got = torch.compile(model, fullgraph=True, backend="aot_eager")(tokens)
    got.sum().backward()
    torch.testing.assert_close(got, expected)
    for path, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[path], msg=path)


@pytest.mark.parametrize(
    ("tokens", "positions", "match"),
    [
        (
            torch.zeros(5, dtype=torch.long),
            None,
            r"tokens of shape \[batch, seq\], got tokens.shape=torch.Size\(\[5\]\)",
        ),
        (
            torch.zeros(1, 257, dtype=torch.long),
            None,
            r"Sequence length 257 exceeds max_seq_len=256",
        ),
        (
            torch.zeros(2, 4, dtype=torch.long),
            torch.arange(5),
            r"positions must have shape \[seq\] = \(4,\).*positions.shape=torch.Size\(\[5\]\)",
        ),
        (torch.zeros(2, 4, dtype=torch.long), torch.arange(4)[None], r"positions must have shape"),
    ],
)
def test_forward_rejects_bad_inputs(
    tokens: torch.Tensor, positions: torch.Tensor | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        Llama(TINY, device="meta")(tokens, positions)


def test_forward_names_tokens_that_are_not_a_tensor() -> None:
    """A list of ids raised "AttributeError: 'list' object has no attribute 'dim'"."""
    with pytest.raises(
        TypeError, match=r"expects tokens as a tensor .*got list; pass torch.tensor"
    ):
        Llama(TINY, device="meta")([[1, 2, 3]])


@pytest.mark.parametrize("shape", [(0, 4), (2, 0)], ids=["no-rows", "no-positions"])
def test_an_empty_batch_gives_empty_logits_and_zero_grads(shape: tuple[int, int]) -> None:
    """Attention's views read the head count as -1, which 0 elements leave ambiguous: raised
    ``cannot reshape tensor of 0 elements``."""
    model = Llama(LlamaConfig.tiny())
    logits = model(torch.zeros(shape, dtype=torch.long))
    assert logits.shape == (*shape, 256)
    logits.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
