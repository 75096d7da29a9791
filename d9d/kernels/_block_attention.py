"""``block_attention``: the per-block attention that ring attention merges, as a registry op.

Its backends are :class:`d9d.parallel.BlockAttention` pairs of forward and backward, not one
function: ``"reference"`` is the math version (any device, exact in float64, the automatic
choice), ``"sdpa"`` the fused CPU SDPA kernel with log-sum-exp, chosen with
``d9d.kernels.use(block_attention="sdpa")``. ``context_parallel`` asks the registry for the
backend when its ring attention starts (``d9d/_sequence_split.py``).
"""

from __future__ import annotations

from ..parallel._block_attention import MATH_BLOCK_ATTENTION
from ..parallel._sdpa_block_attention import SDPA_BLOCK_ATTENTION, sdpa_unavailable
from ._registry import FLOAT_DTYPES, define_op, register_backend

__all__: list[str] = []

define_op("block_attention", MATH_BLOCK_ATTENTION)
register_backend(
    "block_attention",
    "sdpa",
    SDPA_BLOCK_ATTENTION,
    dtypes=FLOAT_DTYPES,
    unavailable=sdpa_unavailable,
    auto=lambda device_type: False,
)
