"""fp8 scales along the tokens of each expert: ``fp8_quantize(x, ..., group_sizes=...)``.

``x [T, C]`` has its rows (tokens) grouped by expert as ``grouped_gemm``'s; its scale groups
run along the rows and never straddle two experts, so each expert's data and scales are those
of ``fp8_quantize`` on its rows alone (bitwise). Shapes need no host sync:

- ``tensorwise``: ``[E, 1, 1]``, one scale per expert;
- ``rowwise`` (a column of each expert's rows): ``[E, 1, C]``;
- ``blockwise``: 128-row tiles starting at each expert's first row, ``block`` ``(128, 1)`` or
  ``(128, 128)``: ``[ceil(T / 128) + E, ceil(C / block[1])]``. Expert ``e``'s ``j``-th tile is
  row ``sum(ceil(group_sizes[:e] / 128)) + j`` (:func:`first_tiles`); the rows past the last
  tile, an upper bound's slack, hold the scale of an all-zero group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._fp8_recipes import AMAX_EPS, fp8_max

__all__ = ["TILE_ROWS", "expand", "expert_scale_shape", "first_tiles", "reference"]

TILE_ROWS = 128  # a blockwise tile's tokens


def expert_scale_shape(
    rows: int, cols: int, experts: int, recipe: str, block: tuple[int, int]
) -> tuple[int, ...]:
    """The scale's shape for ``[rows, cols]`` data over ``experts`` (module doc)."""
    match recipe:
        case "tensorwise":
            return (experts, 1, 1)
        case "rowwise":
            return (experts, 1, cols)
        case _:
            return (-(-rows // TILE_ROWS) + experts, -(-cols // block[1]))


def first_tiles(group_sizes: Tensor) -> Tensor:
    """``[E]``: the scale row of each expert's first 128-row tile (blockwise)."""
    tiles = (group_sizes + TILE_ROWS - 1) // TILE_ROWS
    return tiles.cumsum(0) - tiles


def _row_groups(group_sizes: Tensor, rows: int, recipe: str) -> Tensor:
    """``[rows]``: the scale row each data row uses (its expert, or its tile)."""
    experts = torch.arange(group_sizes.numel(), device=group_sizes.device)
    owner = torch.repeat_interleave(experts, group_sizes, output_size=rows)
    if recipe != "blockwise":
        return owner
    first_rows = group_sizes.cumsum(0) - group_sizes
    within = torch.arange(rows, device=owner.device) - first_rows[owner]
    return first_tiles(group_sizes)[owner] + within // TILE_ROWS


def expand(
    scale: Tensor, group_sizes: Tensor, recipe: str, block: tuple[int, int], rows: int, cols: int
) -> Tensor:
    """``[rows, cols]``: each element's scale."""
    per_row = scale.reshape(scale.shape[0], -1)[_row_groups(group_sizes, rows, recipe)]
    match recipe:
        case "tensorwise":
            group_cols = max(cols, 1)
        case "rowwise":
            group_cols = 1
        case _:
            group_cols = block[1]
    return per_row.repeat_interleave(group_cols, dim=1)[:, :cols]


def reference(
    x: Tensor, group_sizes: Tensor, recipe: str, dtype: torch.dtype, block: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """Each group's amax by a scatter over the rows' groups, then ``fp8_quantize``'s
    division and saturating cast (no loop over experts, no host sync)."""
    (rows, cols), limit = x.shape, fp8_max(dtype)
    shape = expert_scale_shape(rows, cols, group_sizes.numel(), recipe, block)
    wide = x.float()
    magnitude = wide.abs()
    match recipe:
        case "tensorwise":
            magnitude = magnitude.amax(dim=1, keepdim=True) if cols else wide.new_zeros(rows, 1)
        case "blockwise" if block[1] > 1:
            n_cols = shape[1]
            padded = F.pad(magnitude, (0, n_cols * block[1] - cols))
            magnitude = padded.reshape(rows, n_cols, block[1]).amax(dim=2)
    index = _row_groups(group_sizes, rows, recipe)[:, None].expand_as(magnitude)
    groups = wide.new_zeros(shape[0], magnitude.shape[1])
    amax = groups.scatter_reduce(0, index, magnitude, "amax").clamp(min=AMAX_EPS)
    # A tensor divisor, as fp8_quantize's reference divides (bitwise the same scales).
    scale = (amax / torch.full_like(amax, limit)).reshape(shape)
    full = expand(scale, group_sizes, recipe, block, rows, cols)
    return (wide / full).clamp(-limit, limit).to(dtype), scale
