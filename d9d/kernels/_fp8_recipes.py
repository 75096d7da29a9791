"""What the fp8 ops share: the formats, the scaling recipes, each recipe's scale shape, and
where the Triton fp8 kernels can run.

A scale is a **dequantization** scale, in float32: ``x ~= data.float() * scale`` (broadcast
over its group of elements), ``data = saturate(x / scale)``, ``scale = max(amax, 1e-12) /
fp8_max``: the convention of ``torch._scaled_mm`` and of DeepSeek-V3's scale factors.
"""

from __future__ import annotations

import torch

from ..errors import KernelInputError
from ._triton_env import triton_unavailable

__all__ = [
    "AMAX_EPS",
    "BLOCKS",
    "FP8_DTYPES",
    "RECIPES",
    "dequantize",
    "expand_scale",
    "fp8_max",
    "fp8_triton_unavailable",
    "group_shape",
    "scale_shape",
]

FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
RECIPES = ("tensorwise", "rowwise", "blockwise")
# DeepSeek-V3's tiles: 1x128 for activations, 128x128 for weights; 128x1 is the 1x128 tile of
# the transposed activations (the weight gradient's operand).
BLOCKS = ((1, 128), (128, 1), (128, 128))
AMAX_EPS = 1e-12  # an all-zero group gets a tiny scale, and data 0: never a division by zero


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype: 448 (e4m3fn), 57344 (e5m2)."""
    return torch.finfo(dtype).max


def group_shape(
    rows: int, cols: int, recipe: str, dim: int, block: tuple[int, int]
) -> tuple[int, int]:
    """``(rows, cols)`` of the elements that share one scale, in a ``[rows, cols]`` matrix."""
    match recipe:
        case "tensorwise":
            return max(rows, 1), max(cols, 1)
        case "rowwise":
            return (1, max(cols, 1)) if dim == -1 else (max(rows, 1), 1)
        case "blockwise":
            return block
        case _:
            raise KernelInputError(f"unknown fp8 {recipe=}: recipes are {list(RECIPES)}")


def scale_shape(
    shape: tuple[int, ...], recipe: str, dim: int = -1, block: tuple[int, int] = (1, 128)
) -> tuple[int, ...]:
    """The scale's shape for data of ``shape`` (``[..., rows, cols]``): leading dims are
    independent matrices, each with its own scales."""
    *batch, rows, cols = shape
    match recipe, dim:
        case "tensorwise", _:
            return (*batch, 1, 1)
        case "rowwise", -1:
            return (*batch, rows, 1)
        case "rowwise", _:
            return (*batch, 1, cols)
        case _:
            return (*batch, -(-rows // block[0]), -(-cols // block[1]))


def expand_scale(scale: torch.Tensor, group: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """``[..., rows, cols]``: each scale repeated over its ``group`` (ragged edges cut)."""
    full = scale.repeat_interleave(group[0], dim=-2)[..., :rows, :]
    return full.repeat_interleave(group[1], dim=-1)[..., :cols]


def dequantize(data: torch.Tensor, scale: torch.Tensor, group: tuple[int, int]) -> torch.Tensor:
    """``data * scale`` in float32, each scale repeated over its ``group``."""
    return data.float() * expand_scale(scale, group, *data.shape[-2:])


def fp8_triton_unavailable(device_type: str | None) -> str | None:
    """Why the Triton fp8 kernels cannot run here: Triton's, or a GPU older than sm89."""
    reason = triton_unavailable(device_type)
    if reason is not None or device_type not in (None, "cuda") or not torch.cuda.is_available():
        return reason
    if torch.cuda.get_device_capability() < (8, 9):
        return (
            f"fp8 needs compute capability 8.9+, this GPU has {torch.cuda.get_device_capability()}"
        )
    return None
