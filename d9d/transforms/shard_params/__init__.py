"""``shard_params``: FSDP (ZeRO-3), ZeRO-2/1, HSDP and DDP as differences of storage,
compute, grad and optimizer-state layout; its runtime gathers each block's params (ahead of
use, and again in the backward), accumulates microbatches, and under ZeRO-1/2 hands the step
body shards of params stored whole and gathers their updates back."""

from ._runtime import ShardParamsRuntime as ShardParamsRuntime
from ._schedule import Schedule as Schedule
from ._stage import ZeroStage as ZeroStage
from ._transform import ShardParams as ShardParams
from ._transform import shard_params as shard_params

__all__ = ["Schedule", "ShardParams", "ShardParamsRuntime", "ZeroStage", "shard_params"]
