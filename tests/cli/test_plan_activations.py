"""``d9d plan``'s activation estimate against the bytes a real forward keeps (``KeptBytes``)."""

from __future__ import annotations

import math

import pytest
import torch

import d9d
from d9d._context import running
from d9d.cli._plan_activations import ActivationLayout, activation_bytes
from d9d.models import Llama, LlamaConfig
from d9d.testing import KeptBytes, run_on_ranks

pytestmark = pytest.mark.distributed

# Widths that differ from each other (and from the vocab), so no term can stand in for another.
CONFIG = LlamaConfig.small(
    n_layers=2, vocab_size=300, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=200
)
BATCH, SEQ = 2, 48


def _kept(axes: dict[str, int], policy: str) -> int:
    """Bytes of op outputs alive after the forward and loss of rank 0, params excluded."""

    def rank() -> int:
        mesh = d9d.make_mesh("cpu", **axes)
        model = d9d.functionalize(Llama(CONFIG))
        step = lambda p, s, b: (p, s, {})  # noqa: E731
        if "dp" in axes:
            step = d9d.shard_params(mesh, None, replicate_axis="dp")(step)
        if "tp" in axes:
            step = d9d.tensor_parallel(mesh)(step)
        if "cp" in axes:
            step = d9d.context_parallel(mesh)(step)
        if policy != "none":
            step = d9d.remat(policy, mesh=mesh)(step)
        params, _ = step.place(model.params, (), axes=model.axes)
        params = {p: v.detach().requires_grad_(True) for p, v in params.items()}
        skip = {v.to_local().untyped_storage().data_ptr() for v in params.values()}
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=torch.Generator())
        batch = {"tokens": tokens, "labels": tokens}
        with running(step.context()):
            for runtime in step.runtimes:
                batch = runtime.on_batch(batch)
            with KeptBytes() as seen:
                loss = d9d.losses.cross_entropy(
                    model.apply(params, batch["tokens"]), batch["labels"]
                )
            kept = seen.alive(skip)
            del loss
        return kept

    return run_on_ranks(rank, math.prod(axes.values()))[0]


@pytest.mark.parametrize(
    ("axes", "policy"),
    [
        ({"dp": 1}, "none"),
        ({"dp": 1}, "selective"),
        ({"dp": 1}, "full"),
        ({"tp": 2}, "none"),
        ({"tp": 2}, "selective"),
        ({"tp": 2}, "full"),
        ({"cp": 2}, "none"),
        ({"cp": 2}, "full"),
    ],
)
def test_estimate_is_within_10_percent_of_the_measured_bytes(axes: dict, policy: str) -> None:
    layout = ActivationLayout(
        batch=BATCH, seq=SEQ, tp=axes.get("tp", 1), cp=axes.get("cp", 1), remat=policy
    )
    measured, estimate = _kept(axes, policy), activation_bytes(CONFIG, layout)
    print(f"{axes} {policy}: estimate {estimate:,} B, measured {measured:,} B")
    assert abs(estimate - measured) <= 0.1 * measured, (estimate, measured)
