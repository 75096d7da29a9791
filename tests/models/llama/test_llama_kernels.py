"""The Llama calls rms_norm, rope and swiglu through the ``d9d.kernels`` registry."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import d9d.kernels as K
from d9d.errors import KernelUnavailableError
from d9d.models import Llama, LlamaConfig
from d9d.models.llama._model import Block
from d9d.models.llama._ops import rope_cos_sin, rope_inv_freq

TINY = LlamaConfig.tiny()


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("op", ["rms_norm", "rope", "swiglu"])
def test_forcing_an_unavailable_backend_fails_inside_the_forward(
    op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the interpreter, Triton cannot run on CPU tensors: the registry's error proves
    # the model's call went through it.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = Llama(TINY)
    with K.use(**{op: "triton"}), pytest.raises(KernelUnavailableError) as error:
        model(_tokens())
    assert f"d9d.kernels.use({op}='triton'): backend 'triton' of op {op!r}" in str(error.value)


def test_forcing_the_reference_changes_nothing_on_cpu() -> None:
    model = Llama(TINY)
    with torch.no_grad():
        auto = model(_tokens())
        with K.use(rms_norm="reference", rope="reference", swiglu="reference"):
            forced = model(_tokens())
    torch.testing.assert_close(forced, auto, atol=0, rtol=0)


@pytest.mark.compile  # one inductor compile of a forward and its backward (~20 s)
def test_block_compiles_fullgraph_with_inductor(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()
    block = Llama(TINY).layers[0]
    assert isinstance(block, Block)
    x = torch.randn(2, 12, TINY.dim, generator=torch.Generator().manual_seed(1))
    inv_freq = rope_inv_freq(TINY.head_dim, TINY.rope_theta)
    cos, sin = rope_cos_sin(torch.arange(12), inv_freq, x.dtype)

    def loss_and_grads(fn) -> list[torch.Tensor]:
        leaf = x.clone().requires_grad_()
        block.zero_grad()
        out = fn(leaf, cos, sin)
        out.square().mean().backward()
        return [out.detach(), leaf.grad, *(p.grad for p in block.parameters())]

    got = loss_and_grads(torch.compile(block, fullgraph=True))
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    expected = loss_and_grads(block)
    for actual, wanted in zip(got, expected, strict=True):
        torch.testing.assert_close(actual, wanted, atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()
