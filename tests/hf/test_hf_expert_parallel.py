"""A Hugging Face MoE block under ``expert_parallel`` is refused by name: its experts module
is not called as ``experts(rows grouped by expert, group_sizes)``, the seam the transform
intercepts (``docs/moe.md``)."""

from __future__ import annotations

import pytest
from hf_families import build

import d9d
from d9d.errors import RankFailedError
from d9d.testing import run_on_ranks


def _place(model_fn, ranks: int) -> None:
    mesh = d9d.make_mesh("cpu", ep=ranks)
    model = model_fn()
    step = d9d.expert_parallel(mesh)(lambda p, s, b: (p, s, {}))
    step.place(model.params, (), model=model)


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_hugging_face_experts_are_refused_by_name(family: str) -> None:
    model_fn = build(family)
    experts = model_fn().params["model.layers.0.mlp.experts.down_proj"].shape[0]
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: expert_parallel\(axis='ep'\): 'model\.layers\.0\.mlp\.experts\.\w+' "
        r"belongs to module 'model\.layers\.0\.mlp\.experts' \(\w+\), not a d9d\.moe Experts "
        r"module .*d9d\.checkpoint\.import_hf_moe",
    ):
        run_on_ranks(_place, experts, model_fn, experts, timeout=120)  # an ep that divides E
