"""``d9d.moe.MoE`` forward and backward against a dense reference, its losses, the
functional bias update, and a full-graph compile."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import d9d
from d9d.moe import MoE, MoEConfig, load_balance, update_router_bias


def _dense(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by a dense ``[T, E]`` routing matrix."""
    cfg, flat = layer.config, x.reshape(-1, x.shape[-1])
    scores = F.linear(flat, layer.router.weight)
    scores = scores.softmax(-1) if cfg.score_func == "softmax" else scores.sigmoid()
    bias = layer.router.expert_bias
    select = scores.detach() + (bias if bias is not None else 0.0)
    ids = select.topk(cfg.top_k, -1).indices
    weights = scores.gather(-1, ids)
    if cfg.norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    dense = torch.zeros_like(scores).scatter(-1, ids, weights * cfg.routed_scaling_factor)
    out = torch.zeros_like(flat)
    for e in range(cfg.n_experts):
        w = layer.experts
        hidden = F.silu(flat @ w.w_gate[e]) * (flat @ w.w_up[e])
        out = out + dense[:, e : e + 1] * (hidden @ w.w_down[e])
    if layer.shared is not None:
        out = out + layer.shared(flat)
    return out.view_as(x)


CASES = {
    "top1-E5": dict(n_experts=5, top_k=1),
    "top2-E6-shared": dict(n_experts=6, top_k=2, n_shared_experts=2, norm_topk=True),
    "top8-E10-sigmoid": dict(n_experts=10, top_k=8, score_func="sigmoid", norm_topk=True),
    "skewed-empty-experts": dict(n_experts=7, top_k=2, routed_scaling_factor=2.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_match_dense(case: str) -> None:
    cfg = MoEConfig(dim=8, expert_dim=12, bias_update_rate=1e-3, **CASES[case])
    gen = torch.Generator().manual_seed(3)
    layer = MoE(cfg).double()
    layer.init_weights(std=0.3, generator=gen)
    if case.startswith("skewed"):
        with torch.no_grad():
            layer.router.expert_bias.copy_(torch.tensor([3.0, 3.0, 0, 0, 0, 0, 0]))
    x = torch.randn(37, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    got = layer(x)
    if case.startswith("skewed"):
        assert got.load.tolist() == [37.0, 37.0, 0, 0, 0, 0, 0]
    assert got.load.sum().item() == 37 * cfg.top_k
    want = _dense(layer, x)
    torch.testing.assert_close(got.out, want, rtol=1e-10, atol=1e-10)
    probe = torch.randn(37, 8, dtype=torch.float64, generator=gen)
    params = [p for p in layer.parameters() if p.requires_grad]
    got_grads = torch.autograd.grad((got.out * probe).sum(), [x, *params])
    want_grads = torch.autograd.grad((want * probe).sum(), [x, *params])
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_aux_and_z_loss_match_formulas() -> None:
    cfg = MoEConfig(dim=8, n_experts=6, top_k=2, expert_dim=4, aux_loss_coef=0.5, z_loss_coef=0.1)
    layer = MoE(cfg).double()
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    got = layer(x)
    logits = x.reshape(-1, 8) @ layer.router.weight.T
    probs = logits.softmax(-1)
    ids = probs.topk(2, -1).indices
    fraction = torch.bincount(ids.flatten(), minlength=6) / (18 * 2)
    switch = 6 * (fraction * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(got.aux_loss, 0.5 * switch + 0.1 * z)
    assert got.aux_loss.requires_grad


def test_uniform_router_aux_loss_is_one() -> None:
    cfg = MoEConfig(dim=4, n_experts=4, top_k=1, expert_dim=4, aux_loss_coef=1.0, z_loss_coef=1.0)
    layer = MoE(cfg)
    with torch.no_grad():
        layer.router.weight.zero_()
    x = torch.randn(8, 4)
    out = layer(x)
    # all scores tie at 1/4, so topk picks expert 0 for all: f = (1, 0, 0, 0), P = 1/4
    assert out.aux_loss.item() == pytest.approx(1.0 + math.log(4) ** 2)
    assert load_balance(out.load).item() == pytest.approx(4.0)


def test_forward_leaves_bias_unchanged_and_update_is_functional() -> None:
    cfg = MoEConfig(dim=8, n_experts=4, top_k=1, expert_dim=4, bias_update_rate=0.01)
    model = d9d.functionalize(MoE(cfg))
    params = {k: v.clone() for k, v in model.params.items()}
    before = params["router.expert_bias"].clone()
    out = model.apply(params, torch.randn(16, 8))
    assert torch.equal(params["router.expert_bias"], before)
    new = update_router_bias(params, {"": out.load}, 0.01)
    assert torch.equal(params["router.expert_bias"], before)  # the input is untouched
    want = before + 0.01 * torch.sign(out.load.mean() - out.load)
    torch.testing.assert_close(new["router.expert_bias"], want)
    assert new["router.weight"] is params["router.weight"]


def test_update_router_bias_names_missing_bias() -> None:
    with pytest.raises(KeyError, match=re.escape("no param 'layers.1.mlp.router.expert_bias'")):
        update_router_bias({}, {"layers.1.mlp": torch.ones(3)}, 0.1)


@pytest.mark.compile
def test_compiles_fullgraph_one_graph_for_any_routing() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    cfg = MoEConfig(
        dim=8, n_experts=6, top_k=2, expert_dim=12, n_shared_experts=1,
        aux_loss_coef=0.01, z_loss_coef=1e-3, bias_update_rate=1e-3, n_group=2, topk_group=1,
    )  # fmt: skip
    layer = MoE(cfg)
    counter = CompileCounterWithBackend("aot_eager")

    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = layer(x)
        return out.out.square().mean() + out.aux_loss, out.load

    compiled = torch.compile(forward, backend=counter, fullgraph=True)
    torch._dynamo.reset()
    params = [p for p in layer.parameters() if p.requires_grad]
    for seed in range(3):  # a different routing each call
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(seed))
        (loss, load), (want_loss, want_load) = compiled(x), forward(x)
        torch.testing.assert_close(loss, want_loss)
        assert torch.equal(load, want_load)
        got_grads = torch.autograd.grad(loss, params)
        for g, w in zip(got_grads, torch.autograd.grad(want_loss, params), strict=True):
            torch.testing.assert_close(g, w)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_grouped_gemm_backends_agree_in_the_layer(backend: str) -> None:
    """float32: the layer on ``backend`` against the dense reference, forward and backward."""
    why_not = d9d.kernels.available()["grouped_gemm"][backend]
    if why_not is not None:
        pytest.skip(f"grouped_gemm backend {backend}: {why_not}")
    cfg = MoEConfig(dim=24, n_experts=5, top_k=2, expert_dim=40, n_shared_experts=1)
    layer = MoE(cfg)
    layer.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 11, 24, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with d9d.kernels.use(grouped_gemm=backend):
        got = layer(x).out
    want = _dense(layer, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    params = [layer.experts.w_gate, layer.experts.w_down, layer.router.weight, x]
    probe = torch.randn_like(got)
    for g, w in zip(
        torch.autograd.grad((got * probe).sum(), params),
        torch.autograd.grad((want * probe).sum(), params),
        strict=True,
    ):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
