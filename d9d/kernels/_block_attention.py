"""``block_attention``: the per-block attention that ring attention merges, as a registry op.

Its backends are :class:`d9d.parallel.BlockAttention` pairs of forward and backward, not one
function: ``"reference"`` is the math version (any device, exact in float64, the automatic
choice), and three fused SDPA kernels with log-sum-exp are chosen with
``d9d.kernels.use(block_attention=...)``: ``"sdpa"`` on CPU, ``"sdpa_flash"`` (bfloat16,
float16) and ``"sdpa_efficient"`` (float32 too) on CUDA. None is picked automatically: the
CUDA ones have not yet been checked on a GPU against the math version
(``tests/parallel/test_sdpa_cuda.py``). ``context_parallel`` asks the registry for the
backend when its ring attention starts (``d9d/_sequence_split.py``).
"""

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


def _forced_only(device_type: str) -> bool:
    return False


define_op("block_attention", MATH_BLOCK_ATTENTION)
for name, impl, dtypes, unavailable in [
    (
        "sdpa_efficient",
        SDPA_EFFICIENT_BLOCK_ATTENTION,
        FLOAT_DTYPES - {torch.float64},
        cuda_sdpa_unavailable,
    ),
    (
        "sdpa_flash",
        SDPA_FLASH_BLOCK_ATTENTION,
        {torch.bfloat16, torch.float16},
        cuda_sdpa_unavailable,
    ),
    ("sdpa", SDPA_BLOCK_ATTENTION, FLOAT_DTYPES, sdpa_unavailable),
]:
    register_backend(
        "block_attention", name, impl, dtypes=dtypes, unavailable=unavailable, auto=_forced_only
    )
