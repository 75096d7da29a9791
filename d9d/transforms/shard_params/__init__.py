"""``shard_params``: FSDP, HSDP and DDP as a difference of storage and compute layout; its
runtime gathers each block's params (ahead of use, and again in the backward) and
accumulates microbatches."""

from ._runtime import ShardParamsRuntime as ShardParamsRuntime
from ._schedule import Schedule as Schedule
from ._transform import ShardParams as ShardParams
from ._transform import shard_params as shard_params

__all__ = ["Schedule", "ShardParams", "ShardParamsRuntime", "shard_params"]
