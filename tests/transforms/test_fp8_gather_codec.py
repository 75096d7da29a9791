"""The fp8 gather codec on one process: what a rank encodes, the whole weight's scale, and
the fp8 linear computing with the decoded :class:`Fp8Weight` as with the weight itself."""

from __future__ import annotations

import pytest
import torch

from d9d.kernels import fp8_quantize
from d9d.transforms.fp8._gather import Fp8Gather
from d9d.transforms.fp8._linear import fp8_linear
from d9d.transforms.fp8._weight import Fp8Weight


def _gathered(weight: torch.Tensor, codec: Fp8Gather, shards: int = 3) -> Fp8Weight:
    """``weight`` split in row shards, each encoded with the max of their statistics (what
    the all-reduce gives), concatenated (what the all-gather gives) and decoded."""
    parts = weight.tensor_split(shards)
    amax = torch.stack([codec.statistic(p) for p in parts]).amax(dim=0)
    wire = torch.cat([codec.encode(p, amax) for p in parts])
    assert wire.dtype == codec.wire_dtype == torch.uint8
    return codec.decode(wire, amax)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoded_shards_are_the_whole_weights_quantization(dtype):
    weight = torch.randn(50, 48) * 3  # 50 rows over 3 shards: 17, 17, 16
    got = _gathered(weight, Fp8Gather(dtype))
    data, scale = fp8_quantize(weight.to(dtype), "tensorwise")
    assert torch.equal(got.fp8_data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(got.fp8_scale, scale)
    assert got.dtype == dtype and got.shape == weight.shape


def test_an_empty_shard_has_amax_zero():
    assert Fp8Gather(torch.float32).statistic(torch.empty(0, 16)).item() == 0


def test_fp8_linear_with_the_gathered_weight_equals_it_with_the_weight():
    torch.manual_seed(0)
    x = torch.randn(2, 24, 64, requires_grad=True)
    weight = torch.randn(48, 64, requires_grad=True)
    want = fp8_linear(x, weight, None, "tensorwise")
    want.square().sum().backward()
    want_dx, want_dw = x.grad, weight.grad
    x.grad = None
    gathered = _gathered(weight.detach(), Fp8Gather(torch.float32)).requires_grad_()
    got = fp8_linear(x, gathered, None, "tensorwise")
    got.square().sum().backward()
    assert torch.equal(got, want)
    assert torch.equal(x.grad, want_dx)
    assert type(gathered.grad) is torch.Tensor and torch.equal(gathered.grad, want_dw)


def test_any_other_op_on_the_gathered_weight_is_refused():
    gathered = _gathered(torch.randn(32, 16), Fp8Gather(torch.float32))
    assert isinstance(gathered.t().detach(), Fp8Weight)  # layout ops keep data and scale
    with pytest.raises(RuntimeError, match=r"all-gathered in fp8 .* met aten\.add.*exclude"):
        gathered + 1


def test_encode_without_the_reduced_amax_is_refused():
    with pytest.raises(ValueError, match="needs the all-reduced amax"):
        Fp8Gather(torch.float32).encode(torch.randn(4, 16))
