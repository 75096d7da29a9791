"""``d9d plan``'s activation estimate against the bytes a real forward keeps (``KeptBytes``)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import d9d
from d9d._context import running
from d9d.cli._plan_activations import ActivationLayout, activation_bytes, moe_activation_bytes
from d9d.models import Llama, LlamaConfig, MoE, MoEConfig
from d9d.moe import MoEConfig as LayerConfig
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


# Every width differs from the others; explicit head_dim (q != dim), q/k norms, one dense block,
# shared experts and every balancing path, so each term of the MoE formula is exercised.
MOE_CONFIG = MoEConfig(
    vocab_size=300, dim=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=200, head_dim=48,
    qk_norm=True, n_dense_layers=1, max_seq_len=256,
    moe=LayerConfig(
        dim=128, n_experts=7, top_k=3, expert_dim=56, n_shared_experts=1, shared_expert_dim=72,
        norm_topk=True, aux_loss_coef=0.01, z_loss_coef=1e-3, bias_update_rate=1e-3,
    ),
)  # fmt: skip


def _moe_kept(policy: str) -> int:
    """Bytes of op outputs alive after the MoE decoder's forward and loss, params excluded."""

    def rank() -> int:
        model = d9d.functionalize(MoE(MOE_CONFIG))
        params, context = model.params, contextlib.nullcontext()
        if policy != "none":
            step = d9d.remat(policy, mesh=d9d.make_mesh("cpu", dp=1))(lambda p, s, b: (p, s, {}))
            params, _ = step.place(model.params, (), axes=model.axes)
            context = running(step.context())
        params = {p: v.detach().requires_grad_(True) for p, v in params.items()}
        skip = {
            getattr(v, "_local_tensor", v).untyped_storage().data_ptr() for v in params.values()
        }
        tokens = torch.randint(0, MOE_CONFIG.vocab_size, (BATCH, SEQ), generator=torch.Generator())
        with context, KeptBytes() as seen:
            out = model.apply(params, tokens)
            loss = d9d.losses.cross_entropy(out.logits, tokens) + out.aux_loss
        kept = seen.alive(skip)
        del loss, out
        return kept

    return run_on_ranks(rank, 1)[0]


@pytest.mark.parametrize("policy", ["none", "full"])
def test_moe_estimate_is_within_10_percent_of_the_measured_bytes(policy: str) -> None:
    measured = _moe_kept(policy)
    estimate = moe_activation_bytes(
        MOE_CONFIG, ActivationLayout(batch=BATCH, seq=SEQ, remat=policy)
    )
    print(f"moe {policy}: estimate {estimate:,} B, measured {measured:,} B")
    assert abs(estimate - measured) <= 0.1 * measured, (estimate, measured)


def test_moe_estimate_covers_no_tensor_or_context_parallel_layout() -> None:
    for layout in (
        ActivationLayout(batch=2, seq=8, tp=2),
        ActivationLayout(batch=2, seq=8, cp=2),
        ActivationLayout(batch=2, seq=8, remat="selective"),
    ):
        assert moe_activation_bytes(MOE_CONFIG, layout) is None
