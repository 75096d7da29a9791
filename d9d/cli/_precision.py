"""``d9d train --dtype`` and ``--grad-accum``: what they ask of ``shard_params``, which keeps
float32 master weights while blocks gather and compute in ``param_dtype``, and accumulates the
grads of ``microbatches`` slices of the batch before reducing them once; ``--opt-state-dtype``:
the dtype AdamW stores its moments in; ``--master-weights``: the params stored in bfloat16
(``stored_params``) with float32 masters in the optimizer state; ``--zero N``: what
``shard_params`` shards (``ZERO_SHARDS``); ``--offload-opt-state``: where it keeps the
optimizer state."""

from __future__ import annotations

from typing import Any

import torch

from ._config import TrainConfig

__all__ = [
    "ZERO_SHARDS",
    "opt_state_dtype",
    "replica_microbatches",
    "shard_options",
    "stored_params",
]

_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}

ZERO_SHARDS = {1: "opt_state", 2: "grads", 3: "params"}
"""``--zero N``: ``shard_params``' ``shard=`` over ``--fsdp``."""


def shard_options(config: TrainConfig) -> dict[str, Any]:
    """``shard_params`` keyword arguments for ``config``'s dtype, accumulation and
    ``--offload-opt-state``; empty when it asks for none (float32, one microbatch, state on
    the device). Under ``--fault-tolerant`` (without ``--diloco``) ``d9d.fault_tolerant``
    accumulates instead (:func:`replica_microbatches`)."""
    options: dict[str, Any] = {}
    if _DTYPES[config.dtype] is not None:
        options["param_dtype"] = _DTYPES[config.dtype]
        # Summed over ranks, microbatches and (fault_tolerant reads it from the plan) replica
        # groups in float32, as the float32 params' grads are: under --master-weights the
        # params' own dtype would sum bf16 grads in bf16.
        options["reduce_dtype"] = torch.float32
    if config.grad_accum > 1 and not replica_microbatches(config) > 1:
        options["microbatches"] = config.grad_accum
    if config.offload_opt_state:
        options["opt_state_device"] = "cpu"
    return options


def replica_microbatches(config: TrainConfig) -> int:
    """``d9d.fault_tolerant``'s ``microbatches`` for ``config``: ``--grad-accum`` under
    ``--fault-tolerant`` without ``--diloco`` (its all-reduce over the replica groups runs
    once after the last microbatch), else 1."""
    return config.grad_accum if config.fault_tolerant and config.diloco is None else 1


def opt_state_dtype(config: TrainConfig) -> torch.dtype | None:
    """``adamw``'s ``mu_dtype`` and ``nu_dtype`` for ``config``: None (the params' float32)
    unless ``--opt-state-dtype bfloat16``."""
    return _DTYPES[config.opt_state_dtype]


def stored_params(config: TrainConfig, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` as the step stores them: in bfloat16 with ``--master-weights`` (their float32
    masters are the optimizer's state, ``d9d.optim.master_weights``), else as they are."""
    if not config.master_weights:
        return params
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in params.items()}
