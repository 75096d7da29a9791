"""Kernel ops behind one registry (``d9d.kernels``)."""

from ._registry import available as available
from ._registry import register_backend as register_backend
from ._registry import use as use
from ._rms_norm import fused_add_rms_norm as fused_add_rms_norm
from ._rms_norm import rms_norm as rms_norm

__all__ = ["available", "fused_add_rms_norm", "register_backend", "rms_norm", "use"]
