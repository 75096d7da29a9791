"""The MoE decoder's training step on one device, the reference of its distributed tests
(``tests/models/moe/test_moe_distributed.py``, ``test_expert_parallel.py``): float64, 5 AdamW
steps with clipping, aux losses and the bias on, unevenly ignored labels; and the microbatch
accumulation written out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import d9d
from d9d.models.moe import make_train_step

STEPS = 5
TOL = {"rtol": 1e-9, "atol": 1e-12}
# A param whose first nonzero grad is near AdamW's eps (1e-8) moves by lr * g / (|g| + eps),
# whose slope in g there is lr / (4 eps) = 2.5e5: one embedding element (a token seen once,
# grad 4e-8) turns the grads' 1e-17 rounding into up to 6.8e-13 here (cp=2), and 1.8e-12
# under pp=2 with the preset's dense first block. So params get atol 1e-11, 1e-9 of an
# update (lr 1e-2); every other param agrees within 3e-14.
PARAM_TOL = {"rtol": 1e-9, "atol": 1e-11}
METRICS = ("loss", "aux_loss", "load_balance")


def optimizer() -> d9d.optim.GradientTransformation:
    schedule = d9d.optim.warmup_cosine(1e-2, 1, 10, init_value=1e-3)
    return d9d.optim.chain(d9d.optim.clip_by_global_norm(0.5), d9d.optim.adamw(schedule))


def batches() -> list[dict[str, torch.Tensor]]:
    """Rows ignore 0 to 16 of their 16 labels, differently each step: a mean of per-rank or
    per-microbatch means would differ from the global token mean."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(STEPS):
        tokens = torch.randint(0, 256, (8, 17), generator=g)
        labels = tokens[:, 1:].clone()
        for row in range(labels.shape[0]):
            labels[row, : (5 * row + 3 * i) % 17] = -100
        out.append({"tokens": tokens[:, :-1], "labels": labels})
    return out


def trained(step: Any, params: Any, state: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Metrics ``[STEPS, 3]`` and the whole final params of a placed distributed ``step`` run
    over :func:`batches` (each sharded by the step)."""
    metrics = []
    for batch in batches():
        params, state, m = step(params, state, step.shard_batch(batch))
        metrics.append(torch.stack([m[k] for k in METRICS]))
    return torch.stack(metrics), {k: v.full_tensor() for k, v in params.items()}


def reference(build: Callable[[], d9d.Model]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Metrics ``[STEPS, 3]`` and final params of the step on one device."""
    model, opt = build(), optimizer()
    step = make_train_step(model, opt)
    params = {k: v.clone() for k, v in model.params.items()}
    state, metrics = opt.init(params), []
    for batch in batches():
        params, state, m = step(params, state, batch)
        metrics.append(torch.stack([m[k] for k in METRICS]))
    return torch.stack(metrics), params


def accumulated_reference(
    build: Callable[[], d9d.Model], microbatches: int, data_ranks: int = 1
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One device, the step's microbatch accumulation written out (``docs/losses.md``): each
    microbatch's loss is its cross entropy plus the aux loss of its own tokens and weighs by
    its share of the valid labels; the loads of the microbatches add up. Microbatch ``m`` is
    the ``m``-th slice of every data-parallel rank's shard of the batch."""
    model, opt = build(), optimizer()
    rate = model.module.config.moe.bias_update_rate

    def loss_fn(params, batch):
        out = model.apply(params, batch["tokens"])
        ce = d9d.losses.cross_entropy(out.logits, batch["labels"])
        return ce + out.aux_loss, (ce, out.aux_loss, out.expert_load)

    params = {k: v.clone() for k, v in model.params.items()}
    state, metrics = opt.init(params), []
    for batch in batches():
        parts = [
            {
                k: torch.cat([shard.chunk(microbatches)[i] for shard in v.chunk(data_ranks)])
                for k, v in batch.items()
            }
            for i in range(microbatches)
        ]
        counts = torch.stack([(part["labels"] != -100).sum() for part in parts]).double()
        grads, ce, aux, loads = None, 0.0, 0.0, {}
        for part, share in zip(parts, counts / counts.sum(), strict=True):
            (_, (ce_m, aux_m, loads_m)), g = d9d.value_and_grad(loss_fn, has_aux=True)(params, part)
            g = {k: share * v for k, v in g.items()}
            grads = g if grads is None else {k: grads[k] + g[k] for k in g}
            ce, aux = ce + share * ce_m, aux + share * aux_m
            loads = {k: loads.get(k, 0.0) + v for k, v in loads_m.items()}
        balance = d9d.moe.load_balance(torch.stack(list(loads.values())))
        metrics.append(torch.stack([ce, aux, balance.double()]))
        biases = d9d.moe.update_router_bias(params, loads, rate)
        updates, state = opt.update(grads, state, params)
        params = d9d.optim.apply_updates(params, updates)
        params |= {k: v for k, v in biases.items() if k.endswith("expert_bias")}
    return torch.stack(metrics), params
