"""``fp8``'s linear: its three matmuls against an emulation written here (quantize ->
dequantize -> float32 matmul), and their signal to quantization noise against float32 on
random data and on a tiny Llama's activations (issue 28: outputs >= 18 dB, weight grads
>= 17 dB)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import d9d
from d9d.models import Llama, LlamaConfig
from d9d.transforms.fp8 import fp8_linear

RECIPES = ("tensorwise", "rowwise", "blockwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRAD = {"tensorwise": E5M2, "rowwise": E5M2, "blockwise": E4M3}


def _fake_quantize(t: torch.Tensor, group: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """``t [rows, cols]`` cast to ``dtype`` and back, one scale (amax / fp8 max) per group of
    ``group`` elements (ragged groups at the edges), in float32."""
    rows, cols = t.shape
    g0, g1 = min(group[0], rows), min(group[1], cols)
    out = torch.empty(rows, cols)
    limit = torch.finfo(dtype).max
    for r in range(0, rows, g0):
        for c in range(0, cols, g1):
            tile = t[r : r + g0, c : c + g1].float()
            scale = tile.abs().max().clamp(min=1e-12) / limit
            out[r : r + g0, c : c + g1] = (tile / scale).clamp(-limit, limit).to(
                dtype
            ).float() * scale
    return out


def _emulated_matmul(a: torch.Tensor, b: torch.Tensor, recipe: str, a_dtype: torch.dtype):
    """``a [M, K] @ b [K, N]``, ``a`` in ``a_dtype`` and ``b`` in e4m3, each scaled along K."""
    big = 10**9
    a_group, b_group = {
        "tensorwise": ((big, big), (big, big)),
        "rowwise": ((1, big), (big, 1)),
        "blockwise": ((1, 128), (128, 128)),
    }[recipe]
    return _fake_quantize(a, a_group, a_dtype) @ _fake_quantize(b, b_group, E4M3)


def _emulated(x, w, bias, dy, recipe):
    """Output, input grad and weight grad of the linear, emulated."""
    out = _emulated_matmul(x, w.t(), recipe, E4M3) + bias
    grad_x = _emulated_matmul(dy, w, recipe, GRAD[recipe])
    grad_w = _emulated_matmul(dy.t(), x, recipe, GRAD[recipe])
    return out, grad_x, grad_w


def _run(x, w, bias, dy, recipe):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    bias = bias.clone().requires_grad_()
    out = fp8_linear(x, w, bias, recipe)
    out.backward(dy)
    return out.detach(), x.grad, w.grad, bias.grad


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("m,k,n", [(37, 160, 48), (131, 272, 144)])  # blockwise: ragged edges
def test_three_matmuls_equal_the_emulation(recipe, backend, m, k, n):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / 16
    bias, dy = torch.randn(n, generator=g), torch.randn(m, n, generator=g) * 1e-3
    with d9d.kernels.use(fp8_quantize=backend, fp8_gemm=backend):
        out, grad_x, grad_w, grad_b = _run(x, w, bias, dy, recipe)
    want_out, want_x, want_w = _emulated(x, w, bias, dy, recipe)
    for got, want in ((out, want_out), (grad_x, want_x), (grad_w, want_w)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    torch.testing.assert_close(grad_b, dy.sum(0))


def test_leading_dims_and_dtype_kept():
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    out = fp8_linear(x, w.to(torch.bfloat16), None, "rowwise")
    out.float().sum().backward()
    assert (out.shape, out.dtype) == ((2, 5, 32), torch.bfloat16)
    assert (x.grad.dtype, w.grad.dtype) == (torch.bfloat16, torch.float32)


def _sqnr(want: torch.Tensor, got: torch.Tensor) -> float:
    return (10 * torch.log10(want.pow(2).sum() / (want - got).pow(2).sum())).item()


@functools.cache
def _llama_activations() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(x, w, dy)`` of every linear in the blocks of a tiny Llama on a batch of tokens,
    after 20 SGD steps of the float32 model on that batch (so activations and grads are a
    trained model's, not an initialization's)."""
    torch.manual_seed(0)
    module = Llama(LlamaConfig.tiny(n_layers=2))
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    for _ in range(20):
        opt.zero_grad()
        F.cross_entropy(module(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.Linear) and name.startswith("layers."):

            def keep_x(mod, args, name=name):
                seen[name] = [args[0].detach().flatten(0, 1), mod.weight.detach()]

            def keep_dy(mod, grad_in, grad_out, name=name):
                seen[name].append(grad_out[0].detach().flatten(0, 1))

            handles.append(child.register_forward_pre_hook(keep_x))
            handles.append(child.register_full_backward_hook(keep_dy))
    logits = module(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for handle in handles:
        handle.remove()
    return tuple(tuple(v) for v in seen.values())


@pytest.mark.parametrize("recipe", RECIPES)
def test_signal_to_quantization_noise(recipe):
    g = torch.Generator().manual_seed(0)
    cases = [
        (
            torch.randn(256, 512, generator=g),
            torch.randn(384, 512, generator=g) / 22,
            torch.randn(256, 384, generator=g),
        )
    ]
    cases += list(_llama_activations())
    for x, w, dy in cases:
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fp8_linear(xs, ws, None, recipe)
        out.backward(dy)
        assert _sqnr(x @ w.t(), out.detach()) >= 18
        assert _sqnr(dy.t() @ x, ws.grad) >= 17
        assert _sqnr(dy @ w, xs.grad) >= 17
