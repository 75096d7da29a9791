"""The training step of the MoE decoder: cross entropy plus the MoE aux losses, one optimizer
update, then the functional update of the routers' aux-loss-free bias."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from d9d import losses, optim
from d9d.core._autodiff import value_and_grad
from d9d.core._model import Model
from d9d.moe import load_balance, update_router_bias
from d9d.moe._balance import data_mean

__all__ = ["make_train_step"]


def make_train_step(
    model: Model, opt: optim.GradientTransformation, *, grad_norm: bool = False
) -> Callable[..., Any]:
    """``step(params, opt_state, batch) -> (params, opt_state, metrics)`` for a functionalized
    :class:`d9d.models.MoE`.

    The objective is the next-token cross entropy plus the model's ``aux_loss``. After the
    optimizer update each router's ``expert_bias`` (when the config has
    ``bias_update_rate > 0``) moves by :func:`d9d.moe.update_router_bias` on the step's global
    loads, from its value before the step: the bias is a param, so it flows through
    transforms, ``d9d.jit`` and checkpoints, but the optimizer's update of it (zero gradient,
    maybe weight decay) is discarded.

    Args:
        model: ``d9d.functionalize(MoE(config))``.
        opt: The optimizer.
        grad_norm: Also return the global gradient norm (before clipping). Default False.

    Returns:
        The step; ``metrics`` holds 0-d ``"loss"`` (cross entropy), ``"aux_loss"`` and
        ``"load_balance"`` (max over mean expert load of the most unbalanced MoE layer; 1.0
        is perfect), all global, equal on every rank, and ``"grad_norm"`` when asked.

    Example:
        >>> import d9d
        >>> from d9d.models import MoE, MoEConfig
        >>> model = d9d.functionalize(MoE(MoEConfig.tiny()))
        >>> opt = d9d.optim.sgd(0.1)
        >>> step = make_train_step(model, opt)
        >>> tokens = torch.zeros(1, 8, dtype=torch.long)
        >>> batch = {"tokens": tokens, "labels": tokens}
        >>> _, _, metrics = step(model.params, opt.init(model.params), batch)
        >>> sorted(metrics)
        ['aux_loss', 'load_balance', 'loss']
    """
    rate = model.module.config.moe.bias_update_rate
    n_experts = model.module.config.moe.n_experts

    def loss_fn(params: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
        out = model.apply(params, batch["tokens"])
        ce = losses.cross_entropy(out.logits, batch["labels"])
        return ce + out.aux_loss.to(ce.dtype), (ce, out.aux_loss, out.expert_load)

    def step(params: Any, opt_state: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, Any, Any]:
        (_, (ce, aux, loads)), grads = value_and_grad(loss_fn, has_aux=True)(params, batch)
        # Microbatches (shard_params(microbatches=k), pipeline) concatenate each one's [E]
        # load: the step's load is their sum, the load of the whole batch (the routing does
        # not change within a step).
        loads = {k: v.reshape(-1, n_experts).sum(0) for k, v in loads.items()}
        metrics = {"loss": data_mean(ce), "aux_loss": data_mean(aux)}
        if loads:
            metrics["load_balance"] = load_balance(torch.stack(list(loads.values())))
        if grad_norm:
            metrics["grad_norm"] = optim.global_norm(grads)
        # The new biases come from the old ones, computed before the update (which may work
        # in place on donated params) and put over whatever the optimizer did to them. A
        # pipeline rank holds (and updates) only its stages' biases.
        biases = {}
        if rate > 0:
            held = {k: v for k, v in loads.items() if f"{k}.router.expert_bias" in params}
            nudged = update_router_bias(params, held, rate)
            biases = {k: nudged[k] for k in nudged if nudged[k] is not params[k]}
        updates, opt_state = opt.update(grads, opt_state, params)
        return {**optim.apply_updates(params, updates), **biases}, opt_state, metrics

    return step
