"""Each custom op's fake gives its outputs the strides the real op gives them, also for dense
non-contiguous (transposed) inputs: inductor asserts them (a column-major ``x`` failed
``torch.compile`` of grouped_gemm's backward with "expected ... stride 5==1")."""

from __future__ import annotations

import pytest
import torch

import d9d.kernels  # noqa: F401  (registers the torch.ops.d9d custom ops)

# Checked without a compile: schema, fake against real (strides included), autograd.
CHECKS = ("test_schema", "test_faketensor", "test_autograd_registration")


def _transposed(*shape: int, device: str) -> torch.Tensor:
    """A dense tensor of ``shape`` with its dims' order reversed in memory."""
    reverse = list(range(len(shape) - 1, -1, -1))
    return torch.randn(*reversed(shape), device=device).permute(*reverse)


def _cases(device: str) -> dict[str, tuple]:
    torch.manual_seed(0)
    t = lambda *shape: _transposed(*shape, device=device)  # noqa: E731
    labels = torch.randint(0, 9, (5,), device=device)
    sizes = torch.tensor([2, 3], device=device)
    row_map = torch.randperm(10, device=device).view(5, 2)
    ops = torch.ops.d9d
    return {
        "rms_norm": (ops.rms_norm_triton, (t(4, 6), t(4, 6), t(6), 1e-6)),
        "swiglu": (ops.swiglu_triton_backward, (t(4, 6), t(4, 6), t(4, 6))),
        "rope": (ops.rope_triton, (t(2, 3, 2, 4), t(2, 3, 1, 4), t(3, 4), t(3, 4), False)),
        "cross_entropy": (ops.cross_entropy_triton, (t(5, 9), labels, -100)),
        "flce_chunked": (ops.flce_chunked, (t(5, 6), t(9, 6), labels, -100, 2, True, True)),
        "flce_triton": (ops.flce_triton, (t(5, 6), t(9, 6), labels, -100, 2, True, True)),
        "grouped_gemm_torch": (
            ops.grouped_gemm_torch_backward,
            (t(5, 3), t(5, 6), t(2, 6, 3), sizes),
        ),
        "grouped_gemm_triton": (
            ops.grouped_gemm_triton_backward,
            (t(5, 3), t(5, 6), t(2, 6, 3), sizes),
        ),
        "moe_gather_sum": (ops.moe_gather_sum_triton, (t(10, 4), row_map, t(5, 2))),
        "moe_choice_dot": (ops.moe_choice_dot_triton, (t(5, 4), t(10, 4), row_map, t(5, 2))),
    }


@pytest.mark.parametrize("name", list(_cases("cpu")))
def test_fake_strides_match_the_real_op(name, device):
    op, args = _cases(device)[name]
    results = torch.library.opcheck(op.default, args, test_utils=CHECKS)
    assert all(result == "SUCCESS" for result in results.values()), results
