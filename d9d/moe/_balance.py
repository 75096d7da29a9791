"""Load balancing: global expert loads, the Switch aux loss, the router z-loss, and the
functional update of the aux-loss-free bias.

Statistics are global: inside a transformed step the per-expert counts are summed over every
mesh axis on which ranks hold different tokens (``plan.token_groups``: the data axes and
``cp``), with one all-reduce per axis, so a layout equals one device fed the whole batch. Per
token means follow :func:`d9d.losses.token_mean`: a rank returns its sum times the number of
those ranks over the global count, and the step's mean over ranks is the global mean.

Under ``tensor_parallel``'s sequence parallelism the layer also runs on part of each
sequence, the other parts on the ranks of the step context's ``sequence_groups`` (the ``tp``
axis), which compute the same loss and sum their grads: the counts are summed over those
ranks too, a rank's per-token sums are its share of the whole (no factor for those ranks),
and :func:`sequence_sum` completes the aux loss's value while its grad stays the share.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from ..core._context import current
from ..errors import PlanError
from ._config import MoEConfig
from ._routing import Routing

__all__ = [
    "balance_losses",
    "check_loads_in_mesh",
    "data_mean",
    "global_load",
    "load_balance",
    "sequence_sum",
    "update_router_bias",
]

_c10d = torch.ops._c10d_functional


def global_load(expert_ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor, int]:
    """``(load [E] float32, tokens 0-d float32, ranks)``: the choices per expert and the tokens,
    summed over the ranks holding other tokens (one all-reduce per data axis and per axis of
    ``sequence_groups``); ``ranks`` counts those of the data axes, over which grads are
    averaged."""
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(n_experts + 1, dtype=torch.float32, device=flat.device)
    counts = counts.index_add(0, flat, torch.ones_like(flat, dtype=torch.float32))
    counts[n_experts] = expert_ids.shape[0]
    step = current()
    ranks = 1
    for group, size in step.plan.token_groups if step is not None else ():
        counts = _c10d.wait_tensor(_c10d.all_reduce(counts, "sum", group))
        ranks *= size
    for group, _ in step.sequence_groups if step is not None else ():
        counts = _c10d.wait_tensor(_c10d.all_reduce(counts, "sum", group))
    return counts[:n_experts], counts[n_experts], ranks


def sequence_sum(value: Tensor) -> Tensor:
    """The sum of a rank's share ``value`` of a per-token term over the ranks of the step
    context's ``sequence_groups`` (identity when there are none), whose grad is the share's
    own: every one of those ranks adds the whole term to the same loss and their grads are
    summed.

    Example:
        >>> sequence_sum(torch.tensor(2.0))
        tensor(2.)
    """
    step = current()
    if step is None or not step.sequence_groups:
        return value
    total = value.detach()
    for group, _ in step.sequence_groups:
        total = _c10d.wait_tensor(_c10d.all_reduce(total, "sum", group))
    return total + (value - value.detach())  # the value of total, the grad of value


def data_mean(value: Tensor) -> Tensor:
    """The mean of a rank-local ``value`` over the ranks holding other tokens (identity outside
    a transformed step): turns a per-rank loss term, scaled as :func:`d9d.losses.token_mean`
    scales it, into the global one, for metrics.

    Example:
        >>> data_mean(torch.tensor(2.0))
        tensor(2.)
    """
    step = current()
    ranks = 1
    for group, size in step.plan.token_groups if step is not None else ():
        value = _c10d.wait_tensor(_c10d.all_reduce(value, "sum", group))
        ranks *= size
    return value / ranks


def check_loads_in_mesh(config: MoEConfig) -> None:
    """Raise if the layer balances by its loads (``aux_loss_coef``, ``z_loss_coef``,
    ``bias_update_rate``) in a step whose grads are averaged with tokens outside its mesh
    (``fault_tolerant``'s other replica groups), which :func:`global_load` cannot count."""
    step = current()
    if step is None or not (config.aux_loss_coef or config.z_loss_coef or config.bias_update_rate):
        return
    beyond = [r.tokens_beyond_mesh for r in step.runtimes if r.tokens_beyond_mesh]
    if beyond:
        raise PlanError(
            f"d9d.moe sums its expert loads over the step's mesh only, and under {beyond[0]}: "
            "each group would weigh its balance losses by its own loads (not one device's "
            "objective) and nudge its router biases by them (the groups' params would drift "
            "apart); set aux_loss_coef, z_loss_coef and bias_update_rate to 0, or train it "
            "under d9d.diloco (which averages whole params every H steps) instead"
        )


def balance_losses(
    logits: Tensor, routing: Routing, load: Tensor, tokens: Tensor, ranks: int, config: MoEConfig
) -> Tensor:
    """``aux_loss_coef * switch + z_loss_coef * z`` as a 0-d float32 (or wider) tensor.

    ``switch = E * sum_e f_e * P_e`` (Switch Transformer, arXiv:2101.03961): ``f_e`` the global
    fraction of choices routed to ``e`` (no gradient), ``P_e`` the mean score of ``e`` (sigmoid
    scores normalized per token first). ``z = mean_t logsumexp(logits_t) ** 2`` (ST-MoE,
    arXiv:2202.08906). Both are 1 and ``log(E) ** 2`` for a uniform router.
    """
    total = routing.scores.new_zeros(())
    scale = ranks / tokens.clamp(min=1).to(total.dtype)
    if config.aux_loss_coef:
        scores = routing.scores
        if config.score_func == "sigmoid":
            scores = scores / scores.sum(-1, keepdim=True).clamp(min=1e-20)
        fraction = load.to(total.dtype) / (tokens.clamp(min=1) * config.top_k)
        mean_score = scores.sum(0) * scale
        total = total + config.aux_loss_coef * config.n_experts * (fraction * mean_score).sum()
    if config.z_loss_coef:
        z = torch.logsumexp(logits.to(total.dtype), dim=-1).square().sum() * scale
        total = total + config.z_loss_coef * z
    return total


def load_balance(load: Tensor) -> Tensor:
    """Max over mean of the expert loads ``[..., E]`` (1.0: perfectly balanced), 0-d.

    Example:
        >>> load_balance(torch.tensor([1.0, 3.0]))
        tensor(1.5000)
    """
    load = load.to(torch.float32)
    return (load.amax(-1) / load.mean(-1).clamp(min=1e-20)).amax()


def update_router_bias(
    params: Mapping[str, Any], loads: Mapping[str, Tensor], rate: float
) -> dict[str, Any]:
    """New params with each MoE layer's ``router.expert_bias`` nudged toward balance.

    ``b_e <- b_e + rate * sign(mean(load) - load_e)``: the aux-loss-free balancing of
    DeepSeek-V3 (arXiv:2408.15664). Functional: the input params are not modified; call it in
    the training step on the step's (global) loads, after the optimizer update, so the bias
    flows through the step, ``d9d.jit`` and checkpoints like any param. Leave the bias out of
    the optimizer (its gradient is zero; AdamW with no weight decay on 1-d params, as
    ``d9d train`` uses, leaves it unchanged).

    Args:
        params: ``{path: tensor}``, tensors or DTensors (a DTensor bias gets a DTensor update
            on its own placements, with no communication).
        loads: ``{layer path: load [E]}`` as the model returns them, e.g.
            ``{"layers.1.mlp": tensor([...])}``; each load equal on every rank.
        rate: Step of the update, e.g. ``1e-3``.

    Returns:
        A new ``dict`` sharing every other leaf with ``params``.

    Raises:
        KeyError: A layer of ``loads`` has no ``{layer}.router.expert_bias`` in ``params``.

    Example:
        >>> params = {"moe.router.expert_bias": torch.zeros(3)}
        >>> update_router_bias(params, {"moe": torch.tensor([4.0, 1.0, 1.0])}, 0.1)
        {'moe.router.expert_bias': tensor([-0.1000,  0.1000,  0.1000])}
    """
    new = dict(params)
    for layer, load in loads.items():
        key = f"{layer}.router.expert_bias" if layer else "router.expert_bias"
        if key not in params:
            raise KeyError(
                f"update_router_bias: no param {key!r} for the load of layer {layer!r}; build "
                "the layer with MoEConfig(bias_update_rate > 0) to give its router a bias"
            )
        bias = params[key]
        load = load.detach().to(torch.float32)
        delta = (rate * torch.sign(load.mean() - load)).to(bias.dtype)
        if isinstance(bias, DTensor):
            replicated = [Replicate()] * bias.device_mesh.ndim
            delta = DTensor.from_local(delta, bias.device_mesh, replicated, run_check=False)
            delta = delta.redistribute(bias.device_mesh, bias.placements)
        new[key] = bias + delta
    return new
