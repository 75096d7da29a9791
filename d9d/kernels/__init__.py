"""Kernel ops behind one registry (``d9d.kernels``): each op a plain function, each with a
pure-PyTorch reference and faster backends (Triton) chosen by device, dtype and what is
installed, or forced per call (``backend=``), per block (:func:`use`) or by the
``D9D_KERNELS`` environment variable. See ``docs/kernels.md``.
"""

from . import _block_attention  # noqa: F401 - registers the block_attention op
from ._adamw import adamw as adamw
from ._cross_entropy import cross_entropy as cross_entropy
from ._fp8_gemm import fp8_gemm as fp8_gemm
from ._fp8_gemm import fp8_grouped_gemm as fp8_grouped_gemm
from ._fp8_grouped_gemm_k import fp8_grouped_gemm_k as fp8_grouped_gemm_k
from ._fp8_quantize import fp8_quantize as fp8_quantize
from ._fused_linear_cross_entropy import fused_linear_cross_entropy as fused_linear_cross_entropy
from ._grouped_gemm import grouped_gemm as grouped_gemm
from ._moe_dispatch import combine as combine
from ._moe_dispatch import dispatch as dispatch
from ._moe_dispatch_layout import DispatchGroup as DispatchGroup
from ._moe_dispatch_layout import DispatchHandle as DispatchHandle
from ._moe_dispatch_layout import DispatchLayout as DispatchLayout
from ._moe_dispatch_layout import dispatch_layout as dispatch_layout
from ._moe_permute import moe_permute as moe_permute
from ._moe_permute import moe_unpermute as moe_unpermute
from ._registry import available as available
from ._registry import register_backend as register_backend
from ._registry import use as use
from ._rms_norm import fused_add_rms_norm as fused_add_rms_norm
from ._rms_norm import rms_norm as rms_norm
from ._rope import rope as rope
from ._swiglu import swiglu as swiglu

__all__ = [
    "DispatchGroup",
    "DispatchHandle",
    "DispatchLayout",
    "adamw",
    "available",
    "combine",
    "cross_entropy",
    "dispatch",
    "dispatch_layout",
    "fp8_gemm",
    "fp8_grouped_gemm",
    "fp8_grouped_gemm_k",
    "fp8_quantize",
    "fused_add_rms_norm",
    "fused_linear_cross_entropy",
    "grouped_gemm",
    "moe_permute",
    "moe_unpermute",
    "register_backend",
    "rms_norm",
    "rope",
    "swiglu",
    "use",
]
