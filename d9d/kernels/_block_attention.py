"""``block_attention``: the per-block attention that ring attention merges, as a registry op.

Its backends are :class:`d9d.parallel.BlockAttention` pairs of forward and backward, not one
function: ``"reference"`` is the math version (any device, exact in float64), and three
fused SDPA kernels return the log-sum-exp: ``"sdpa"`` on CPU, ``"sdpa_flash"`` (bfloat16,
float16) and ``"sdpa_efficient"`` (float32 too) on CUDA. On CUDA the automatic choice is
``sdpa_flash``, else ``sdpa_efficient``, else the reference (float64); both matched the math
version on an H100 (``tests/parallel/test_sdpa_cuda.py``). On CPU it is the reference: the
CPU ``sdpa`` is chosen with ``d9d.kernels.use(block_attention="sdpa")``. ``context_parallel``
asks the registry for the backend when its ring attention starts (``d9d/transforms/context_parallel/_split.py``)."""

from __future__ import annotations

import torch

from ..parallel._block_attention import MATH_BLOCK_ATTENTION
from ..parallel._sdpa_block_attention import (
    SDPA_BLOCK_ATTENTION,
    SDPA_EFFICIENT_BLOCK_ATTENTION,
    SDPA_FLASH_BLOCK_ATTENTION,
    cuda_sdpa_unavailable,
    sdpa_unavailable,
)
from ._registry import FLOAT_DTYPES, define_op, register_backend

__all__: list[str] = []


def _on_cuda(device_type: str) -> bool:
    return device_type == "cuda"


def _forced_only(device_type: str) -> bool:
    return False


define_op("block_attention", MATH_BLOCK_ATTENTION)
# Registered last-first: automatic selection tries sdpa, sdpa_flash, sdpa_efficient, reference.
for name, impl, dtypes, unavailable, auto in [
    (
        "sdpa_efficient",
        SDPA_EFFICIENT_BLOCK_ATTENTION,
        FLOAT_DTYPES - {torch.float64},
        cuda_sdpa_unavailable,
        _on_cuda,
    ),
    (
        "sdpa_flash",
        SDPA_FLASH_BLOCK_ATTENTION,
        {torch.bfloat16, torch.float16},
        cuda_sdpa_unavailable,
        _on_cuda,
    ),
    ("sdpa", SDPA_BLOCK_ATTENTION, FLOAT_DTYPES, sdpa_unavailable, _forced_only),
]:
    register_backend(
        "block_attention", name, impl, dtypes=dtypes, unavailable=unavailable, auto=auto
    )
