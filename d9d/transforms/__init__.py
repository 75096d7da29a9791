"""Transforms of a training step onto a device mesh (``d9d.transforms``)."""

from ._shard_params import ShardParams as ShardParams
from ._shard_params import shard_params as shard_params

__all__ = ["ShardParams", "shard_params"]
