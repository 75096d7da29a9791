"""Launch parameters shared by the Triton kernels: tile sizes, warps, program counts.

On a GPU a program handles one row (or a few short ones). The CPU interpreter runs programs
one after another at about 3 ms each whatever their size (measured on the 2-core CI machine),
so there a program takes a tile of many rows, vectorized by numpy.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = [
    "INTERPRETING",
    "num_warps",
    "persistent_programs",
    "row_max",
    "row_sum",
    "tile_rows",
]

# Fixed when the kernels are decorated, like Triton's own choice of the interpreter.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "yes", "on"}
_TILE_ELEMENTS = 65536 if INTERPRETING else 2048


def _interpretable(fn: triton.JITFunction) -> triton.JITFunction:
    """``fn``, one of Triton's own ``@triton.jit`` functions, callable from d9d's kernels.

    Triton decorates its standard library when it is first imported, and importing
    ``torch._dynamo`` imports it. If ``TRITON_INTERPRET=1`` was set only after that (as the
    test suite does, because setting it before torch breaks ``torch.compile`` elsewhere),
    those functions are compiled-mode objects the interpreter cannot call: wrap them again.
    The interpreter still recognizes their reductions and runs them with numpy.
    """
    if not INTERPRETING:
        return fn
    from triton.runtime.interpreter import InterpretedFunction

    return fn if isinstance(fn, InterpretedFunction) else InterpretedFunction(fn.fn)


# The only standard-library functions the kernels call; sigmoid and zeros are written out.
row_sum = _interpretable(tl.sum)
row_max = _interpretable(tl.max)


def num_warps(block: int) -> int:
    """Warps for a program working on ``block`` elements."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def tile_rows(block: int, n_rows: int) -> int:
    """Rows per program (a power of two) for rows padded to ``block`` elements."""
    return max(1, min(_TILE_ELEMENTS // block, triton.next_power_of_2(max(n_rows, 1))))


def persistent_programs(device: torch.device, n_tiles: int) -> tuple[int, int]:
    """``(programs, tiles per program)`` for a kernel that loops over ``n_tiles`` (> 0) tiles."""
    if device.type == "cuda":
        # Two per SM: the RMSNorm backward at 8192 x 4096 and x 14336 (bfloat16, H100) ran
        # 11% and 7% faster than with four.
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 1  # the interpreter runs programs one after another: fewer is faster
    per_program = triton.cdiv(n_tiles, min(target, n_tiles))
    return triton.cdiv(n_tiles, per_program), per_program
