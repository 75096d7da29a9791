"""Parallel attention building blocks (``d9d.parallel``): ring attention over the ``cp`` axis
and the sequence layouts it runs on. See ``docs/context_parallel.md``.
"""

from ._block_attention import MATH_BLOCK_ATTENTION as MATH_BLOCK_ATTENTION
from ._block_attention import BlockAttention as BlockAttention
from ._ring_attention import ring_attention as ring_attention
from ._zigzag import positions_for as positions_for
from ._zigzag import shard_sequence as shard_sequence
from ._zigzag import unshard_sequence as unshard_sequence
from ._zigzag import zigzag_shard as zigzag_shard
from ._zigzag import zigzag_unshard as zigzag_unshard

__all__ = [
    "MATH_BLOCK_ATTENTION",
    "BlockAttention",
    "positions_for",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
    "zigzag_shard",
    "zigzag_unshard",
]
