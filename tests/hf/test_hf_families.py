"""Every Hugging Face family ``d9d.hf`` has rules for, functionalized with no ``axes``, trains
under fsdp=2, tp=2, cp=2 and pp=2 as on one device (float64, AdamW, uneven ignored labels);
where a family cannot run under a transform, the error says why."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from equivalence import assert_equivalent, reference
from hf_families import FAMILIES, build, data

import d9d
from d9d.errors import RankFailedError
from d9d.testing import run_on_ranks

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "fsdp=2": ({"fsdp": 2}, lambda mesh: [d9d.shard_params(mesh, "fsdp")]),
    "tp=2": ({"tp": 2}, lambda mesh: [d9d.tensor_parallel(mesh)]),
    "tp=2 no sp": ({"tp": 2}, lambda mesh: [d9d.tensor_parallel(mesh, sequence_parallel=False)]),
    "cp=2": ({"cp": 2}, lambda mesh: [d9d.context_parallel(mesh)]),
    "pp=2": ({"pp": 2}, lambda mesh: [d9d.pipeline(mesh, microbatches=2)]),
}

# Families whose blocks tensor_parallel runs replicated (fused or Conv1D projections kept whole):
# no sequence parallelism, which would split their attention. The MoE families' routed experts
# are whole on tp too, but their MoE blocks are position-wise (d9d.hf.POSITION_WISE): each rank
# routes its positions, so they run with sequence parallelism.
WHOLE_BLOCKS_ON_TP = ("phi3", "gpt2")
# Gemma's norms scale by (1 + weight) in float32, so their weight grads are float32 sums whose
# order differs with the layout: rel 1e-5 (tests/distributed/test_shard_params.py, the same).
# atol 1e-7: gemma2 under tp=2 (transformers 5.24) moved two embedding elements whose grads sit
# near AdamW's eps by 1.8e-8 (rel 5.7e-5); with the norms computed in float64 instead, the
# same layout equals one device at the default rel 1e-9.
F32_NORM_GRADS = ("gemma", "gemma2")


def _tp_layout(family: str) -> str:
    return "tp=2 no sp" if family in WHOLE_BLOCKS_ON_TP else "tp=2"


CASES = [
    (family, layout)
    for family in FAMILIES
    for layout in ("fsdp=2", _tp_layout(family), "cp=2", "pp=2")
    if not (family == "gemma2" and layout == "cp=2")
]


@functools.cache
def _reference(family: str):
    return reference(build(family), data())


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_family_equals_one_device(family: str, layout: str) -> None:
    mesh_axes, transforms = LAYOUTS[layout]
    tol = {"rtol": 1e-5, "atol": 1e-7} if family in F32_NORM_GRADS else None
    assert_equivalent(
        build(family),
        transforms,
        mesh_axes,
        data(),
        _reference(family),
        dtype=torch.float64,
        tol=tol,
        method="fork" if "pp" in mesh_axes else "thread",
    )


def test_gemma2_with_float64_norms_equals_one_device_at_the_default_tolerance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the looser Gemma tolerance allows is the float32 rounding of its norms, no more:
    with the norms in the model's float64, tp=2 (the layout that needed atol 1e-7) is exact."""
    from transformers.models.gemma2 import modeling_gemma2

    def float64_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x) * (1.0 + self.weight)

    monkeypatch.setattr(modeling_gemma2.Gemma2RMSNorm, "forward", float64_norm)
    make = build("gemma2")
    mesh_axes, transforms = LAYOUTS["tp=2"]
    assert_equivalent(
        make, transforms, mesh_axes, data(), reference(make, data()), dtype=torch.float64
    )


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3_moe"])
def test_remat_of_the_blocks_equals_one_device(family: str, policy: str) -> None:
    """The blocks recomputed (``Model.apply`` passes ``use_cache=False``: a cache would get the
    recomputed block's keys a second time, which selective checkpointing refuses)."""
    assert_equivalent(
        build(family),
        lambda mesh: [d9d.shard_params(mesh, "fsdp"), d9d.remat(policy, mesh=mesh)],
        {"fsdp": 2},
        data(),
        _reference(family),
        dtype=torch.float64,
    )


@pytest.mark.parametrize("family", WHOLE_BLOCKS_ON_TP)
def test_sequence_parallelism_over_whole_blocks_is_refused(family: str) -> None:
    """Under sequence parallelism a block kept whole on tp would attend over S / tp positions."""
    make = build(family)

    def rank():
        model = make()
        step = d9d.tensor_parallel(d9d.make_mesh("cpu", tp=2))(lambda p, s, b: (p, s, {}))
        step.place(model.params, (), model=model)

    with pytest.raises(
        RankFailedError, match=r"PlanError: module '.*' holds '.*' whole on 'tp' and no sharded"
    ):
        run_on_ranks(rank, 2)


@pytest.mark.parametrize(("family", "source"), [("qwen3_moe", "call"), ("mixtral", "config")])
def test_router_logits_are_refused_under_sequence_parallelism(family: str, source: str) -> None:
    """Each rank's MoE blocks route its S / tp positions, so the router logits transformers
    builds its aux loss from would be the rank's own. Asked for in the call or the config."""
    make = build(family, output_router_logits=source == "config")

    def rank() -> None:
        model = make()
        step = d9d.tensor_parallel(d9d.make_mesh("cpu", tp=2))(
            lambda p, s, b: (p, s, {"out": model.apply(p, b["tokens"], **asked)})
        )
        params, state = step.place(model.params, (), model=model)
        step(params, state, data(1)[0])

    asked = {"output_router_logits": True} if source == "call" else {}
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: the model is asked for its router logits \(output_router_logits=True\), "
        r"but under sequence parallelism its position-wise module 'model\.layers\.0\.mlp'",
    ):
        run_on_ranks(rank, 2)


def _cp_forward(make: Callable[[], d9d.Model]) -> None:
    model = make()
    step = d9d.context_parallel(d9d.make_mesh("cpu", cp=2))(
        lambda p, s, b: (p, s, {"logits": model.apply(p, b["tokens"]).logits})
    )
    params, state = step.place(model.params, (), model=model)
    step(params, state, data(1)[0])


def test_gemma2_soft_capped_attention_is_refused_under_cp() -> None:
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: Gemma2Attention soft-caps its attention scores \(softcap=50.0\)",
    ):
        run_on_ranks(_cp_forward, 2, build("gemma2"))


def _sweep_builder(family: str, axes: dict | None = None) -> Callable[[], d9d.Model]:
    import copy

    from sweep import _module

    module = _module(family)  # the sweep's tiny float64 config
    return lambda: d9d.functionalize(copy.deepcopy(module), axes=axes)


@pytest.mark.parametrize(
    ("family", "axes", "layout", "match"),
    [
        # StableLM: no tp plan, so its linears keep nn.Linear's default axes. Sharding its
        # heads crashes in its attention (it reshapes with the global head count); kept
        # whole, as the message says, its attention runs replicated (no sp) beside its
        # sharded MLP.
        (
            "stablelm",
            {
                r"self_attn\.[qkvo]_proj\.weight$": ("embed", "embed"),
                r"mlp\.(gate|up)_proj\.weight$": ("mlp", "embed"),
                r"mlp\.down_proj\.weight$": ("embed", "mlp"),
                r"lm_head\.weight$": ("vocab", "embed"),
            },
            "tp=2 no sp",
            r"'model\.layers\.0\.self_attn\.q_proj\.weight' \(shape \(48, 48\)\) has "
            r"nn\.Linear's default axes \('out', 'in'\).*axes=\{r'\\\.q_proj\\\.weight\$'",
        ),
    ],
)
def test_params_no_rule_names_are_refused_with_rules_that_equal_one_device(
    family: str, axes: dict, layout: str, match: str
) -> None:
    """The PlanError for a param that no rule names says which rule keeps it whole (before:
    ``rules={None: None}``); given that rule, the family equals one device."""
    mesh_axes, transforms = LAYOUTS["tp=2"]
    with pytest.raises(RankFailedError, match="PlanError: param " + match):
        assert_equivalent(
            _sweep_builder(family), transforms, mesh_axes, data(1), ((), {}), dtype=torch.float64
        )
    make = _sweep_builder(family, axes)
    mesh_axes, transforms = LAYOUTS[layout]
    assert_equivalent(
        make, transforms, mesh_axes, data(2), reference(make, data(2)), dtype=torch.float64
    )
