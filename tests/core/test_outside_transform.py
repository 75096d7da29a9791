"""A transform written outside ``d9d``: the protocol is open.

``ScaleGrad`` below is all a user writes to scale the grads of chosen params (a per-layer
learning-rate factor, say): a frozen dataclass with a phase and a rule. It edits no file of
``d9d`` and composes with ``shard_params`` and ``tensor_parallel`` in any decorator order;
the grads equal the one-device step's with the chosen ones scaled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import d9d
from d9d.models import Llama, LlamaConfig
from d9d.testing import assert_trees_all_close, run_on_ranks
from d9d.transforms import ParamPlan, Phase, Transform

pytestmark = pytest.mark.distributed


@dataclass(frozen=True)
class ScaleGrad(Transform):
    """Multiply the grad of every param whose path matches ``pattern`` by ``factor``."""

    name: ClassVar[str] = "scale_grad"
    phase: ClassVar[Phase] = Phase.COMPUTE_FORM
    mesh: DeviceMesh
    pattern: str
    factor: float

    def claimed_axes(self) -> tuple[str, ...]:
        return ()

    def rewrite(self, entry: ParamPlan) -> ParamPlan:
        if not re.search(self.pattern, entry.path):
            return entry
        reason = f"scale_grad: grads times {self.factor}"
        return replace(entry, grad_scale=self.factor, reasons=(*entry.reasons, reason))


PATTERN, FACTOR = r"^layers\.0\.attn\.wq\.weight$|^norm\.weight$", 0.5


def _model() -> d9d.Model:
    torch.manual_seed(0)
    return d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=2)).to(torch.float64))


def _batch() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def _grad_step(model: d9d.Model) -> Any:
    def loss_fn(params: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return d9d.losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])

    def step(params: Any, opt_state: Any, batch: dict) -> tuple[Any, Any, Any]:
        loss, grads = d9d.value_and_grad(loss_fn)(params, batch)
        return grads, opt_state, {"loss": loss}

    return step


@pytest.mark.parametrize("outermost", [True, False])
def test_a_transform_defined_outside_d9d_scales_grads_under_fsdp_and_tp(outermost: bool) -> None:
    model = _model()
    want, _, _ = _grad_step(model)(model.params, (), _batch())
    want = {p: g * FACTOR if re.search(PATTERN, p) else g for p, g in want.items()}

    def rank() -> tuple[dict[str, torch.Tensor], str]:
        mesh = d9d.make_mesh("cpu", fsdp=2, tp=2)
        model = _model()
        transforms = [d9d.shard_params(mesh), d9d.tensor_parallel(mesh)]
        scale = ScaleGrad(mesh, PATTERN, FACTOR)
        transforms = [scale, *transforms] if outermost else [*transforms, scale]
        step = _grad_step(model)
        for transform in reversed(transforms):
            step = transform(step)
        params, state = step.place(model.params, (), model=model)
        grads, _, _ = step(params, state, step.shard_batch(_batch()))
        return {p: g.full_tensor() for p, g in grads.items()}, step.plan.explain(
            "layers.0.attn.wq.weight"
        )

    for grads, explained in run_on_ranks(rank, 4):
        assert_trees_all_close(grads, want)
        assert "scale_grad: grads times 0.5" in explained
