"""The step ``d9d train`` runs and ``d9d plan`` lays out: the loss and its update
(``make_train_step``), the optimizer of the flags (``_optimizer``) and the transforms of the
job's mesh (``_parallel``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import losses, optim
from ..core._autodiff import value_and_grad
from ..core._mesh import make_mesh
from ..core._model import Model
from ..transforms import (
    context_parallel,
    expert_parallel,
    fp8,
    pipeline,
    shard_params,
    tensor_parallel,
)
from ..transforms.pipeline import SCHEDULES
from ._config import TrainConfig
from ._options import fp8_pattern
from ._precision import ZERO_SHARDS, opt_state_dtype, shard_options

__all__ = ["make_train_step", "with_fp8"]


def make_train_step(
    model: Model, opt: optim.GradientTransformation, *, grad_norm: bool = False
) -> Callable[..., Any]:
    """The step ``d9d train`` runs: next-token cross entropy, grads, one optimizer update.

    Args:
        model: A functionalized language model: ``model.apply(params, tokens) -> logits``.
        opt: The optimizer.
        grad_norm: Also return the global norm of the gradients, before clipping (one more
            norm over the grads per step; ``d9d train`` checks it). Default ``False``.

    Returns:
        ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` where ``batch``
        holds ``"tokens"`` and ``"labels"`` of shape ``[batch, seq_len]`` and ``metrics``
        the 0-d ``"loss"`` (and ``"grad_norm"``), equal on every rank.

    Example:
        >>> from d9d import functionalize
        >>> from d9d.models import Llama, LlamaConfig
        >>> model = functionalize(Llama(LlamaConfig.tiny()))
        >>> opt = optim.sgd(0.1)
        >>> step = make_train_step(model, opt)
        >>> tokens = torch.zeros(1, 8, dtype=torch.long)
        >>> _, _, metrics = step(model.params, opt.init(model.params), {"tokens": tokens, "labels": tokens})
        >>> metrics["loss"].shape
        torch.Size([])
    """

    def loss_fn(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])

    def step(params: Any, opt_state: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, Any, Any]:
        loss, grads = value_and_grad(loss_fn)(params, batch)
        metrics = {"loss": loss}
        if grad_norm:
            metrics["grad_norm"] = optim.global_norm(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, metrics

    return step


def _optimizer(config: TrainConfig) -> optim.GradientTransformation:
    schedule = optim.warmup_cosine(
        config.lr,
        min(config.warmup, config.steps - 1),
        max(config.steps, 2),
        end_value=config.lr / 10,
    )
    moments = opt_state_dtype(config)
    adamw = optim.adamw(
        schedule,
        b2=0.95,
        weight_decay=config.weight_decay,
        mask=_decays,
        mu_dtype=moments,
        nu_dtype=moments,
    )
    # --offload-opt-state: AdamW updates on the host, where shard_params keeps its state; the
    # clipping's global norm stays on the device (a collective over every rank's grads).
    opt = optim.chain(
        optim.clip_by_global_norm(config.clip),
        optim.offloaded(adamw) if config.offload_opt_state else adamw,
    )
    return optim.master_weights(opt) if config.master_weights else opt


def _decays(path: str, param: torch.Tensor) -> bool:
    return param.ndim >= 2


_AXES = ("pp", "dp", "fsdp", "ep", "cp", "tp")


def with_fp8(config: TrainConfig, mesh: Any, step: Any) -> Any:
    """``step`` under ``d9d.fp8`` as ``--fp8``, ``--fp8-include``, ``--fp8-exclude`` and
    ``--fp8-gather`` say (as it is without ``--fp8``)."""
    if config.fp8 is None:
        return step
    return fp8(
        mesh,
        config.fp8,
        include=fp8_pattern(config.fp8_include),
        exclude=fp8_pattern(config.fp8_exclude),
        gather_in_fp8=config.fp8_gather,
    )(step)


def pipeline_microbatches(config: TrainConfig) -> int:
    """The microbatches a step is split into under ``--pp``: ``--microbatches``, by default
    2 x ``--pp``; 1 without a pipeline."""
    pp = config.pp or 1
    return (config.microbatches or 2 * pp) if pp > 1 else 1


def _check_fp8_gather(config: TrainConfig, fsdp: int) -> None:
    """``--fp8-gather`` needs weights that ``shard_params`` all-gathers: ``--fsdp`` ranks under
    ``--zero 3``."""
    if config.fp8_gather and (fsdp == 1 or config.zero != 3):
        raise ValueError(
            f"--fp8-gather all-gathers the fp8 weights of --fsdp ranks under --zero 3, and "
            f"this run has --fsdp {fsdp} and --zero {config.zero}: give --fsdp ranks with "
            "--zero 3 (the default), or drop --fp8-gather"
        )


def _parallel(config: TrainConfig, step: Callable[..., Any]) -> Any:
    """``step`` under the transforms of the job's ``pp x dp x fsdp x cp x tp`` mesh (``fsdp``:
    the ranks the others leave), or as it is outside a job."""
    if config.zero != 3 and not dist.is_initialized():
        raise ValueError(
            f"--zero {config.zero} shards over --fsdp ranks, and this is one process: launch "
            "with `torchrun --nproc-per-node N -m d9d train ...`, or drop --zero"
        )
    if not dist.is_initialized():
        _check_fp8_gather(config, fsdp=1)
        return step
    world = dist.get_world_size()
    sizes = {name: getattr(config, name) or 1 for name in _AXES if name != "fsdp"}
    others = math.prod(sizes.values())
    fsdp = config.fsdp or max(world // others, 1)
    if others * fsdp != world:
        product = " x ".join(f"--{k} {v}" for k, v in {**sizes, "fsdp": fsdp}.items())
        raise ValueError(
            f"{product} is {others * fsdp} ranks but torchrun started {world}; make their "
            "product the number of ranks"
        )
    # Only the axes in use: DTensor's sharding propagation slows down steeply with the
    # number of mesh dims (a foreach op on a 5-D mesh takes minutes to plan).
    axes = {name: size for name, size in {**sizes, "fsdp": fsdp}.items() if size > 1}
    # Before the one-rank axis below: --dtype or --grad-accum adds it, not ranks.
    if config.zero != 3 and axes.get("fsdp", 1) == 1:
        raise ValueError(
            f"--zero {config.zero} shards over --fsdp, which is 1 here; give --fsdp more "
            "ranks, or drop --zero"
        )
    _check_fp8_gather(config, fsdp)
    options = shard_options(config)
    if options and not {"dp", "fsdp"} & set(axes):
        # shard_params' precision, accumulation and host state over one rank, on a replicate
        # axis: nothing to gather or reduce (a one-rank fsdp axis would copy every param
        # each step, though with no collective).
        axes["dp"] = 1
    mesh = make_mesh(**(axes or {"fsdp": 1}))
    if "dp" in axes or "fsdp" in axes:
        shard_axis = "fsdp" if "fsdp" in axes else None
        replicate_axis = "dp" if "dp" in axes else None
        if shard_axis is not None:
            options["shard"] = ZERO_SHARDS[config.zero]
        step = shard_params(mesh, shard_axis, replicate_axis=replicate_axis, **options)(step)
    if sizes["tp"] > 1:
        step = tensor_parallel(mesh)(step)
    if sizes["cp"] > 1:
        step = context_parallel(mesh)(step)
    if sizes["ep"] > 1:
        step = expert_parallel(mesh)(step)
    step = with_fp8(config, mesh, step)
    if sizes["pp"] > 1:
        step = pipeline(
            mesh,
            schedule=config.schedule,
            microbatches=pipeline_microbatches(config),
            virtual_stages=2 if SCHEDULES[config.schedule].multi else 1,
        )(step)
    return step
