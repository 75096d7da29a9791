"""``fp8``'s routed experts: the grouped GEMM's three matmuls against an emulation written here
(each expert's rows quantized with their own scales, dequantized, float32 matmul) on uneven
and empty groups, their signal to quantization noise against float32 (issue 28: outputs
>= 18 dB, weight grads >= 17 dB), and a ``d9d.fp8`` MoE step that runs its experts in fp8."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import d9d
import d9d.kernels as K
from d9d.kernels import grouped_gemm
from d9d.models import MoE, MoEConfig
from d9d.transforms.fp8 import _experts
from d9d.transforms.fp8._experts import fp8_grouped_gemm_experts
from d9d.transforms.fp8._gather import Fp8Gather
from d9d.transforms.fp8._weight import Fp8Weight

RECIPES = ("tensorwise", "rowwise", "blockwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRAD = {"tensorwise": E5M2, "rowwise": E5M2, "blockwise": E4M3}
BIG = 10**9
# The scale groups of a GEMM's a [M, K] and b [K, N] operands, both along K.
GROUPS = {
    "tensorwise": ((BIG, BIG), (BIG, BIG)),
    "rowwise": ((1, BIG), (BIG, 1)),
    "blockwise": ((1, 128), (128, 128)),
}


@pytest.fixture(autouse=True)
def alone() -> Iterator[None]:
    assert not dist.is_initialized()
    yield


def _fake_quantize(t: torch.Tensor, group: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """``t [rows, cols]`` cast to ``dtype`` and back, one scale (amax / fp8 max) per group of
    ``group`` elements (ragged at the edges), in float32."""
    rows, cols = t.shape
    out = torch.zeros(rows, cols)
    if t.numel() == 0:
        return out
    g0, g1, limit = min(group[0], rows), min(group[1], cols), torch.finfo(dtype).max
    for r in range(0, rows, g0):
        for c in range(0, cols, g1):
            tile = t[r : r + g0, c : c + g1].float()
            scale = tile.abs().max().clamp(min=1e-12) / limit
            out[r : r + g0, c : c + g1] = (tile / scale).clamp(-limit, limit).to(
                dtype
            ).float() * scale
    return out


def _matmul(a, b, recipe, a_dtype):
    a_group, b_group = GROUPS[recipe]
    return _fake_quantize(a, a_group, a_dtype) @ _fake_quantize(b, b_group, E4M3)


def _emulated(x, w, dy, sizes, recipe):
    """Output, input grad and weight grad, one expert at a time on its rows alone (blockwise
    weight-grad tiles start at the expert's first row)."""
    out, grad_x = torch.zeros(x.shape[0], w.shape[2]), torch.zeros_like(x)
    grad_w, start = torch.zeros_like(w), 0
    for e, n in enumerate(sizes):
        rows = slice(start, start + n)
        out[rows] = _matmul(x[rows], w[e], recipe, E4M3)
        grad_x[rows] = _matmul(dy[rows], w[e].t(), recipe, GRAD[recipe])
        grad_w[e] = _matmul(dy[rows].t(), x[rows], recipe, GRAD[recipe]).t()
        start += n
    return out, grad_x, grad_w


def _run(x, w, dy, sizes, recipe):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8_grouped_gemm_experts(x, w, torch.tensor(sizes), recipe)
    out.backward(dy)
    return out.detach(), x.grad, w.grad


CASES = {
    "uneven, one empty": ([10, 0, 20, 7], 160, 48),
    "ragged 128 edges": ([131, 3, 0, 40], 272, 144),
    "tiles from each expert's first row": ([100, 200, 5], 24, 40),  # not the global 128s
    "all rows in one expert": ([0, 0, 25], 40, 64),  # the tiny MoE's odd expert width
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("case", list(CASES))
def test_three_matmuls_equal_the_emulation(recipe, backend, case):
    sizes, k, n = CASES[case]
    g = torch.Generator().manual_seed(k)
    # Experts of different magnitudes: one scale per expert shows against a shared one.
    x = torch.randn(sum(sizes), k, generator=g) * torch.linspace(0.1, 4, sum(sizes))[:, None]
    w = (
        torch.randn(len(sizes), k, n, generator=g)
        / 16
        * torch.arange(1, len(sizes) + 1)[:, None, None]
    )
    dy = torch.randn(sum(sizes), n, generator=g) * 1e-3
    with d9d.kernels.use(fp8_quantize=backend, fp8_gemm=backend, fp8_grouped_gemm=backend):
        got = _run(x, w, dy, sizes, recipe)
    want_all = _emulated(x, w, dy, sizes, recipe)
    for name, have, want in zip(("out", "dx", "dw"), got, want_all, strict=True):
        atol = 1e-6 * want.abs().max().item()
        torch.testing.assert_close(have, want, rtol=1e-5, atol=atol, msg=name)


def test_no_rows():
    w = torch.randn(3, 32, 16, requires_grad=True)
    x = torch.zeros(0, 32, requires_grad=True)
    out = fp8_grouped_gemm_experts(x, w, torch.zeros(3, dtype=torch.long), "tensorwise")
    out.sum().backward()
    assert out.shape == (0, 16) and x.grad.shape == (0, 32)
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_a_weight_gathered_in_fp8_is_taken_as_it_is():
    """The experts' weight as the fp8 gather hands it over (``Fp8Gather(stacked=True)``'s
    encode and decode of the whole stack, one scale per expert): as an ``Fp8Weight`` (eager)
    and as the plain ``(weight, data, scale)`` of ``d9d.jit``, whose ``weight`` takes the
    weight grad, the output, input grad and weight grad are those of the weight itself,
    bitwise."""
    sizes, g = [10, 0, 20, 7], torch.Generator().manual_seed(1)
    x = torch.randn(sum(sizes), 48, generator=g)
    w = torch.randn(4, 48, 32, generator=g) * torch.arange(1, 5)[:, None, None]
    dy = torch.randn(sum(sizes), 32, generator=g)
    want = _run(x, w, dy, sizes, "tensorwise")
    codec = Fp8Gather(torch.float32, stacked=True)
    amax = codec.statistic(w)
    gathered = codec.decode(codec.encode(w, amax), amax)
    assert isinstance(gathered, Fp8Weight) and gathered.fp8_scale.shape == (4, 1, 1)
    parts = (torch.zeros_like(w, requires_grad=True), gathered.fp8_data, gathered.fp8_scale)
    for weight in (gathered, parts):
        x_ = x.clone().requires_grad_()
        out = fp8_grouped_gemm_experts(x_, weight, torch.tensor(sizes), "tensorwise")
        out.backward(dy)
        assert torch.equal(out, want[0]) and torch.equal(x_.grad, want[1])
    assert torch.equal(parts[0].grad, want[2])


def _sqnr(want: torch.Tensor, got: torch.Tensor) -> float:
    return (10 * torch.log10(want.pow(2).sum() / (want - got).pow(2).sum())).item()


@pytest.mark.parametrize("recipe", RECIPES)
def test_signal_to_quantization_noise(recipe):
    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([100, 0, 37, 200, 19])
    x = torch.randn(int(sizes.sum()), 256, generator=g)
    w = torch.randn(5, 256, 192, generator=g) / 16
    dy = torch.randn(int(sizes.sum()), 192, generator=g)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8_grouped_gemm_experts(xs, ws, sizes, recipe)
    out.backward(dy)
    exact_x, exact_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = grouped_gemm(exact_x, exact_w, sizes)
    want.backward(dy)
    assert _sqnr(want.detach(), out.detach()) >= 18
    assert _sqnr(exact_w.grad, ws.grad) >= 17
    assert _sqnr(exact_x.grad, xs.grad) >= 17


def test_moe_step_runs_its_experts_in_fp8():
    """The step's logits equal the model's with every experts module's ``gemm`` set to the
    fp8 grouped GEMM by hand (and differ from the model's own)."""
    model = d9d.functionalize(MoE(MoEConfig.tiny()))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    step = d9d.fp8(recipe="rowwise", include="experts")(
        lambda p, s, b: (p, s, model.apply(p, b).logits)
    )
    params, _ = step.place(model.params, (), model=model)
    got = step(params, (), tokens)[2]
    plain = model.module(tokens).logits
    experts = model.module.layers[1].mlp.experts
    experts.gemm = lambda x, w, sizes: fp8_grouped_gemm_experts(x, w, sizes, "rowwise")
    want = model.module(tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, plain)


def test_remat_recomputes_the_fp8_experts_bitwise():
    """``remat("full")`` recomputes the MoE block in the backward: the experts compute in fp8
    again (the seam is set whenever the block runs), and the grads are the fp8 step's."""
    model = d9d.functionalize(MoE(MoEConfig.tiny()))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads(transforms):
        loss = lambda p, t: model.apply(p, t).logits.float().square().mean()  # noqa: E731
        step = lambda p, s, t: (d9d.grad(loss)(p, t), s, {})  # noqa: E731
        for transform in transforms:
            step = transform(step)
        params, _ = step.place(model.params, (), model=model)
        return {k: v.full_tensor() for k, v in step(params, (), tokens)[0].items()}

    want = grads([d9d.fp8(recipe="rowwise", include="experts")])
    got = grads([d9d.remat("full"), d9d.fp8(recipe="rowwise", include="experts")])
    plain = grads([d9d.remat("full")])
    for path in want:
        assert torch.equal(got[path], want[path]), path
    assert not torch.equal(plain["layers.1.mlp.experts.w_up"], want["layers.1.mlp.experts.w_up"])


@pytest.mark.compile
def test_jit_traces_one_graph_with_fp8_experts_equal_to_eager():
    model = d9d.functionalize(MoE(MoEConfig.tiny()))
    mesh = d9d.make_mesh(fsdp=1)  # one mesh for both steps: a jitted step guards on its mesh
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss(params, tokens):
        return model.apply(params, tokens).logits.float().square().mean()

    body = lambda p, s, b: (p, s, d9d.value_and_grad(loss)(p, b))  # noqa: E731
    step = d9d.fp8(mesh, "tensorwise", include="experts")(body)
    jitted = d9d.jit(backend="aot_eager", fullgraph=True)(
        d9d.fp8(mesh, "tensorwise", include="experts")(body)
    )
    params, _ = step.place(model.params, (), model=model)
    jparams, _ = jitted.place(model.params, (), model=model)
    want_loss, want = step(params, (), tokens)[2]
    got_loss, got = jitted(jparams, (), tokens)[2]
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    for path in ("layers.1.mlp.experts.w_gate", "layers.1.mlp.experts.w_down"):
        scale = want[path].abs().max().item()
        torch.testing.assert_close(got[path], want[path], rtol=1e-5, atol=1e-6 * scale)
    assert jitted.traces == 1


def _per_expert_weight_grad(x, dy, sizes, recipe):
    """The weight grad as computed before ``fp8_grouped_gemm_k``: per expert, ``fp8_gemm`` of
    ``dy.T`` and ``x`` over all rows with the other experts' rows zeroed, quantized along the
    tokens (blockwise tiles at global multiples of 128)."""
    rows, grads, start = torch.arange(x.shape[0]), [], 0
    for n in sizes:
        mine = ((rows >= start) & (rows < start + n))[:, None]
        a = K.fp8_quantize(torch.where(mine, dy, 0.0).t(), recipe, GRAD[recipe])
        b = K.fp8_quantize(torch.where(mine, x, 0.0), recipe, dim=-2, block=(128, 128))
        grads.append(K.fp8_gemm(*a, *b, recipe, torch.float32, backend="reference").t())
        start += n
    return torch.stack(grads)


@pytest.mark.parametrize("recipe", RECIPES)
def test_weight_grad_equals_the_per_expert_path(recipe):
    """Same quantized operands (experts start at multiples of 128, so blockwise tiles agree),
    float32 sums in another order: equal within float32 rounding (1e-6 of the largest)."""
    sizes = [128, 0, 256, 37]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(sizes), 40, generator=g) * torch.linspace(0.1, 4, sum(sizes))[:, None]
    w, dy = torch.randn(4, 40, 24, generator=g), torch.randn(sum(sizes), 24, generator=g)
    with d9d.kernels.use(fp8_quantize="reference", fp8_grouped_gemm_k="reference"):
        _, _, grad_w = _run(x, w, dy, sizes, recipe)
    want = _per_expert_weight_grad(x, dy, sizes, recipe)
    torch.testing.assert_close(grad_w, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def test_weight_grad_reads_each_token_row_once(monkeypatch):
    """The backward quantizes ``x`` and ``dy`` once each over their ``T`` rows and multiplies
    them in one ``fp8_grouped_gemm_k`` (before: ``E`` quantizations and GEMMs of all rows)."""
    calls = []

    def counting(name, op):
        def call(*args, **kwargs):
            calls.append((name, args[0].shape))
            return op(*args, **kwargs)

        return call

    for name in ("fp8_quantize", "fp8_grouped_gemm", "fp8_grouped_gemm_k"):
        monkeypatch.setattr(_experts, name, counting(name, getattr(_experts, name)))
    sizes = [5, 0, 9, 3, 7, 0, 1, 11]
    x = torch.randn(sum(sizes), 32, requires_grad=True)
    w = torch.randn(len(sizes), 32, 16, requires_grad=True)
    out = fp8_grouped_gemm_experts(x, w, torch.tensor(sizes), "rowwise")
    calls.clear()
    out.backward(torch.randn_like(out))
    assert calls.count(("fp8_quantize", x.shape)) == 1  # x, for the weight grad
    assert calls.count(("fp8_quantize", out.shape)) == 2  # dy: the input grad, the weight grad
    assert calls.count(("fp8_grouped_gemm_k", x.shape)) == 1
    assert sum(name == "fp8_grouped_gemm_k" for name, _ in calls) == 1
