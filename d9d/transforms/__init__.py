"""Transforms of a training step onto a device mesh (``d9d.transforms``)."""

from ._context_parallel import ContextParallel as ContextParallel
from ._context_parallel import context_parallel as context_parallel
from ._pipeline import Pipeline as Pipeline
from ._pipeline import pipeline as pipeline
from ._shard_params import ShardParams as ShardParams
from ._shard_params import shard_params as shard_params
from ._tensor_parallel import DEFAULT_RULES as DEFAULT_RULES
from ._tensor_parallel import TensorParallel as TensorParallel
from ._tensor_parallel import tensor_parallel as tensor_parallel

__all__ = [
    "DEFAULT_RULES",
    "ContextParallel",
    "Pipeline",
    "ShardParams",
    "TensorParallel",
    "context_parallel",
    "pipeline",
    "shard_params",
    "tensor_parallel",
]
