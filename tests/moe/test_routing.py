"""``d9d.moe.route`` against a plain per-token loop, and ``MoEConfig`` validation."""

from __future__ import annotations

import math

import pytest
import torch

from d9d.errors import ConfigError
from d9d.moe import MoEConfig, route


def _reference(logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None):
    """One token at a time, in Python lists: ids (sorted) and their weights."""
    out = []
    group_size = cfg.n_experts // cfg.n_group
    for row in logits.tolist():
        if cfg.score_func == "softmax":
            peak = max(row)
            exps = [math.exp(v - peak) for v in row]
            scores = [e / sum(exps) for e in exps]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        select = [s + (bias[e].item() if bias is not None else 0.0) for e, s in enumerate(scores)]
        allowed = set(range(cfg.n_experts))
        if cfg.n_group > 1:
            group_scores = []
            for g in range(cfg.n_group):
                members = sorted(select[g * group_size : (g + 1) * group_size], reverse=True)
                group_scores.append(sum(members[:2]))
            groups = sorted(range(cfg.n_group), key=lambda g: -group_scores[g])[: cfg.topk_group]
            allowed = {e for e in allowed if e // group_size in groups}
        chosen = sorted(allowed, key=lambda e: -select[e])[: cfg.top_k]
        weights = [scores[e] for e in chosen]
        if cfg.norm_topk:
            weights = [w / sum(weights) for w in weights]
        weights = [w * cfg.routed_scaling_factor for w in weights]
        out.append(dict(zip(chosen, weights, strict=True)))
    if cfg.capacity_factor is not None:
        capacity = math.ceil(cfg.capacity_factor * len(out) * cfg.top_k / cfg.n_experts)
        seen = [0] * cfg.n_experts
        for choices in out:  # token order, then the order of the choices (best first)
            for e in list(choices):
                if seen[e] >= capacity:
                    choices[e] = 0.0
                seen[e] += 1
    return out


CASES = {
    "top1-softmax": dict(n_experts=6, top_k=1),
    "top2-softmax-norm": dict(n_experts=6, top_k=2, norm_topk=True),
    "top8-E10": dict(n_experts=10, top_k=8, routed_scaling_factor=1.5),
    "sigmoid-groups": dict(
        n_experts=12, top_k=3, score_func="sigmoid", norm_topk=True, n_group=4, topk_group=2
    ),
    "sigmoid-groups-of-one": dict(
        n_experts=5, top_k=2, score_func="sigmoid", n_group=5, topk_group=3
    ),
    "capacity": dict(n_experts=6, top_k=2, capacity_factor=1.0),
}


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_route_matches_per_token_loop(case: str, with_bias: bool) -> None:
    cfg = MoEConfig(dim=4, expert_dim=4, **CASES[case])
    gen = torch.Generator().manual_seed(len(case))
    logits = torch.randn(37, cfg.n_experts, dtype=torch.float64, generator=gen)
    logits[:, 0] += 1.5  # skewed, so capacity drops something
    bias = (
        torch.randn(cfg.n_experts, dtype=torch.float64, generator=gen) * 0.3 if with_bias else None
    )
    routing = route(logits, cfg, bias)
    want = _reference(logits, cfg, bias)
    assert routing.expert_ids.shape == (37, cfg.top_k)
    for t, choices in enumerate(want):
        ids = routing.expert_ids[t].tolist()
        assert sorted(ids) == sorted(choices), f"token {t}"
        got = dict(zip(ids, routing.weights[t].tolist(), strict=True))
        for e, w in choices.items():
            assert got[e] == pytest.approx(w, rel=1e-12, abs=1e-12), f"token {t} expert {e}"
    if cfg.capacity_factor is not None:
        assert (routing.weights == 0).any()


def test_bias_changes_selection_not_weights() -> None:
    cfg = MoEConfig(dim=4, n_experts=4, top_k=1, expert_dim=4)
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    routing = route(logits, cfg, torch.tensor([0.0, 5.0, 0.0, 0.0], dtype=torch.float64))
    assert routing.expert_ids.tolist() == [[1]]
    assert routing.weights.item() == pytest.approx(logits.softmax(-1)[0, 1].item())


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(top_k=7), "top_k=7 exceeds n_experts=6"),
        (dict(n_experts=0), "n_experts must be a positive int"),
        (dict(n_group=4), "n_experts=6 must divide into n_group=4"),
        (dict(n_group=3, topk_group=1, top_k=3), "hold fewer than top_k=3"),
        (dict(score_func="relu"), "score_func='relu'"),
        (dict(capacity_factor=0.0), "capacity_factor=0.0 must be a finite number > 0"),
        (dict(aux_loss_coef=-1.0), "aux_loss_coef must be a finite number >= 0"),
        (dict(bias_update_rate=math.inf), "bias_update_rate must be a finite number >= 0"),
        (dict(n_shared_experts=-1), "n_shared_experts=-1 must be an int >= 0"),
        # Each was accepted: a width of 0 built shared experts of expert_dim, 1.5 shared
        # experts or a float width crashed in torch.empty, a capacity of inf in math.ceil.
        (dict(n_shared_experts=1, shared_expert_dim=0), "shared_expert_dim=0 a positive int"),
        (dict(n_shared_experts=1.5), "n_shared_experts=1.5 must be an int"),
        (dict(n_shared_experts=1, shared_expert_dim=2.5), "shared_expert_dim=2.5 a positive"),
        (dict(capacity_factor=math.inf), "capacity_factor=inf must be a finite number > 0"),
        (dict(capacity_factor=True), "capacity_factor=True must be a finite number"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0 must be a finite number"),
        (dict(routed_scaling_factor="2.5"), "routed_scaling_factor='2.5' must be"),
        (dict(norm_topk="yes"), "norm_topk='yes' must be True or False"),
    ],
)
def test_config_errors(fields: dict, match: str) -> None:
    base = dict(dim=4, n_experts=6, top_k=2, expert_dim=4)
    with pytest.raises(ConfigError, match=match):
        MoEConfig(**(base | fields))
