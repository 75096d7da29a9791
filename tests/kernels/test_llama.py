"""The d9d Llama on the Triton backends (what CUDA selects) matches it on the references."""

from __future__ import annotations

import pytest
import torch

import d9d.kernels as K
from d9d.models import Llama, LlamaConfig

TRITON = {"rms_norm": "triton", "rope": "triton", "swiglu": "triton"}
REFERENCE = dict.fromkeys(TRITON, "reference")


def _logits_and_grads(model: Llama, tokens: torch.Tensor, backends: dict) -> list[torch.Tensor]:
    model.zero_grad()
    with K.use(**backends):
        logits = model(tokens)
    logits.float().square().mean().backward()
    return [logits.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_on_triton_matches_reference(device, assert_close, dtype) -> None:
    model = Llama(LlamaConfig.tiny(), device=device).to(dtype)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    got = _logits_and_grads(model, tokens, TRITON)
    expected = _logits_and_grads(model, tokens, REFERENCE)
    for actual, wanted in zip(got, expected, strict=True):
        assert_close(actual, wanted, dtype)
