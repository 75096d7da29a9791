"""``shard_params``: FSDP, HSDP and DDP as a difference of storage and compute layout, with
gradient accumulation over microbatches."""

from ._accumulate import Accumulation as Accumulation
from ._transform import ShardParams as ShardParams
from ._transform import shard_params as shard_params

__all__ = ["Accumulation", "ShardParams", "shard_params"]
