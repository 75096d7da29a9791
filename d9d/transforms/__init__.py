"""Transforms of a training step onto a device mesh (``d9d.transforms``)."""

from ._shard_params import ShardParams as ShardParams
from ._shard_params import shard_params as shard_params
from ._tensor_parallel import DEFAULT_RULES as DEFAULT_RULES
from ._tensor_parallel import TensorParallel as TensorParallel
from ._tensor_parallel import tensor_parallel as tensor_parallel

__all__ = ["DEFAULT_RULES", "ShardParams", "TensorParallel", "shard_params", "tensor_parallel"]
