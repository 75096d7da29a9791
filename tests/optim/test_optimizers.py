"""Every optimizer alias against ``torch.optim`` (or a hand-written Lion), in one table.

Each row runs 20 steps of random gradients on a dict of odd-shaped fp32 params and
compares the parameter trajectory with torch's to 1e-6, with: nothing else ("plain"), a
weight-decay mask that skips biases and norms ("mask"; torch: two param groups), global
norm clipping ("clip"; torch: ``clip_grad_norm_`` before ``step``), and a warmup-cosine
schedule ("schedule"; torch: ``group["lr"]`` set each step). Each update is also checked
to leave its input gradients and the previous state untouched.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import d9d.optim as optim
from d9d import tree

SHAPES = {
    "blocks.0.attn.bias": (7,),
    "blocks.0.attn.weight": (5, 3),
    "blocks.0.mlp.weight": (4, 3, 2),
    "norm.weight": (6,),
}
NO_DECAY = r"^(?!.*(bias|norm))"  # selects the params that are decayed
STEPS = 20
MAX_NORM = 5.0
WARMUP, DECAY = 5, 15


def warmup_cosine_closed_form(peak: float, step: int) -> float:
    """The lr of ``optim.warmup_cosine(peak, WARMUP, DECAY)`` at ``step``, in plain Python."""
    if step < WARMUP:
        return peak * step / WARMUP
    progress = min(step - WARMUP, DECAY - WARMUP) / (DECAY - WARMUP)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


class ReferenceLion(torch.optim.Optimizer):
    """Lion as the paper's pseudocode (arXiv:2302.06675, Program 1), one tensor at a time."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], weight_decay: float):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                direction = (b1 * m + (1 - b1) * p.grad).sign()
                p.mul_(1 - group["lr"] * group["weight_decay"]).sub_(group["lr"] * direction)
                m.mul_(b2).add_((1 - b2) * p.grad)


@dataclass(frozen=True)
class Row:
    name: str
    lr: float
    weight_decay: float
    ours: Callable[..., optim.GradientTransformation]  # (learning_rate, mask) -> optimizer
    theirs: Callable[..., torch.optim.Optimizer]  # (param_groups, lr) -> torch optimizer


NADAM_WITHOUT_MOMENTUM_DECAY = 1e9  # 0.96 ** (step * 1e9) == 0, so NAdam's mu_t == b1


ROWS = [
    Row(
        "adamw",
        1e-2,
        0.1,
        lambda lr, mask: optim.adamw(lr, b1=0.8, b2=0.95, weight_decay=0.1, mask=mask),
        lambda groups, lr: torch.optim.AdamW(groups, lr=lr, betas=(0.8, 0.95), weight_decay=0.1),
    ),
    Row(
        "adamw_nesterov",
        1e-2,
        0.1,
        lambda lr, mask: optim.adamw(lr, weight_decay=0.1, nesterov=True, mask=mask),
        lambda groups, lr: torch.optim.NAdam(
            groups,
            lr=lr,
            weight_decay=0.1,
            decoupled_weight_decay=True,
            momentum_decay=NADAM_WITHOUT_MOMENTUM_DECAY,
        ),
    ),
    Row(
        "adam",
        1e-2,
        0.0,
        lambda lr, mask: optim.adam(lr, eps=1e-6),
        lambda groups, lr: torch.optim.Adam(groups, lr=lr, eps=1e-6),
    ),
    Row(
        "sgd",
        0.02,
        0.0,
        lambda lr, mask: optim.sgd(lr),
        lambda groups, lr: torch.optim.SGD(groups, lr=lr),
    ),
    Row(
        "sgd_momentum",
        0.02,
        0.0,
        lambda lr, mask: optim.sgd(lr, momentum=0.9),
        lambda groups, lr: torch.optim.SGD(groups, lr=lr, momentum=0.9),
    ),
    Row(
        "sgd_nesterov",
        0.02,
        0.0,
        lambda lr, mask: optim.sgd(lr, momentum=0.9, nesterov=True),
        lambda groups, lr: torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True),
    ),
    Row(
        "sgd_momentum_weight_decay",
        0.02,
        0.05,
        lambda lr, mask: optim.sgd(lr, momentum=0.5, weight_decay=0.05, mask=mask),
        lambda groups, lr: torch.optim.SGD(groups, lr=lr, momentum=0.5, weight_decay=0.05),
    ),
    Row(
        "lion",
        1e-2,
        0.1,
        lambda lr, mask: optim.lion(lr, weight_decay=0.1, mask=mask),
        lambda groups, lr: ReferenceLion(groups, lr=lr, betas=(0.9, 0.99), weight_decay=0.1),
    ),
]
FEATURES = ["plain", "mask", "clip", "schedule"]
CASES = [
    pytest.param(row, feature, id=f"{row.name}-{feature}")
    for row in ROWS
    for feature in FEATURES
    if feature != "mask" or row.weight_decay > 0
]


def make_params(generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {path: 0.1 * torch.randn(shape, generator=generator) for path, shape in SHAPES.items()}


def make_grads(generator: torch.Generator, step: int) -> dict[str, torch.Tensor]:
    size = 0.5 if step % 2 else 2.0  # global norm ~3.4 or ~13.6: clipping acts on half the steps
    return {path: size * torch.randn(shape, generator=generator) for path, shape in SHAPES.items()}


def torch_param_groups(params: dict[str, torch.Tensor], row: Row, feature: str) -> list[dict]:
    if feature != "mask":
        return [{"params": list(params.values())}]
    decayed = [p for path, p in params.items() if re.search(NO_DECAY, path)]
    kept = [p for path, p in params.items() if not re.search(NO_DECAY, path)]
    assert decayed and kept, "the mask must split the params for the test to mean anything"
    return [{"params": decayed}, {"params": kept, "weight_decay": 0.0}]


def clone(tree_: Any) -> Any:
    return tree.map(torch.clone, tree_)


def assert_unchanged(before: Any, after: Any, what: str) -> None:
    for (path, old), new in zip(
        tree.flatten_with_paths(before)[0], tree.leaves(after), strict=True
    ):
        assert torch.equal(old, new), f"update mutated {what} at {path}"


@pytest.mark.parametrize(("row", "feature"), CASES)
def test_matches_torch_trajectory(row: Row, feature: str) -> None:
    generator = torch.Generator().manual_seed(0)
    params = make_params(generator)
    reference = {path: p.clone().requires_grad_(True) for path, p in params.items()}

    learning_rate = optim.warmup_cosine(row.lr, WARMUP, DECAY) if feature == "schedule" else row.lr
    opt = row.ours(learning_rate, NO_DECAY if feature == "mask" else None)
    if feature == "clip":
        opt = optim.chain(optim.clip_by_global_norm(MAX_NORM), opt)
    torch_opt = row.theirs(torch_param_groups(reference, row, feature), row.lr)

    state = opt.init(params)
    for step in range(STEPS):
        grads = make_grads(generator, step)
        for path, p in reference.items():
            p.grad = grads[path].clone()
        if feature == "clip":
            torch.nn.utils.clip_grad_norm_(list(reference.values()), MAX_NORM)
        if feature == "schedule":
            for group in torch_opt.param_groups:
                group["lr"] = warmup_cosine_closed_form(row.lr, step)
        torch_opt.step()

        grads_before, state_before = clone(grads), clone(state)
        updates, new_state = opt.update(grads, state, params)
        assert_unchanged(grads_before, grads, "the gradients")
        assert_unchanged(state_before, state, "the previous state")
        params, state = optim.apply_updates(params, updates), new_state

        for path, p in params.items():
            torch.testing.assert_close(
                p, reference[path].detach(), atol=1e-6, rtol=0, msg=f"{path} at {step=}"
            )
