"""``d9d plan``'s activation figures: the formula and the dry run on meta, against each other
and against the bytes a real forward keeps (``KeptBytes``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import d9d
from d9d.cli.plan import _measured_step
from d9d.cli.plan._activations import (
    ActivationLayout,
    activation_bytes,
    in_flight,
    moe_activation_bytes,
)
from d9d.cli.plan._dry_run import DryRun, dry_run, meta_as_cpu
from d9d.cli.plan._measured_step import StepFlags, measure, place_as_trained, plan_step
from d9d.cli.plan._models import build_model
from d9d.cli.plan._report import human
from d9d.cli.plan._show import show_plan
from d9d.core._context import running
from d9d.models import Llama, LlamaConfig, MoE, MoEConfig
from d9d.moe import MoEConfig as LayerConfig
from d9d.testing import KeptBytes, fake_world, run_on_ranks
from d9d.transforms.pipeline import _executor as pipeline_executor
from d9d.transforms.pipeline._stage_trace import stage_spans

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


def test_formula_covers_no_selective_remat_under_context_parallelism() -> None:
    layout = ActivationLayout(batch=BATCH, seq=SEQ, cp=2, remat="selective")
    assert activation_bytes(CONFIG, layout) is None


# ``d9d plan`` measures what rank 0's forward keeps on meta (``dry_run``: d9d train's step on
# a simulated world, KeptBytes at the first backward op). Below: that figure against the
# formula, and against KeptBytes on gloo ranks running the same step on real tensors.


def _sizes(axes: dict[str, int]) -> dict[str, int]:
    return {"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "tp": 1, **axes}


def _meta_kept(
    build: Callable[[], torch.nn.Module],
    family: str,
    axes: dict,
    policy: str,
    microbatches: int = 1,
) -> int:
    """Bytes ``d9d plan``'s dry run measures for a model built by ``build`` (measured whole,
    not extrapolated) on the layout ``axes``."""
    sizes = _sizes(axes)
    with fake_world(math.prod(sizes.values())):
        with torch.device("meta"):
            model = d9d.functionalize(build())
        step, opt = plan_step(model, sizes, family, None, policy, "1f1b", microbatches)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        tokens = torch.zeros(BATCH * microbatches, SEQ, dtype=torch.long, device="meta")
        return dry_run(step, params, state, {"tokens": tokens, "labels": tokens}).kept


# value_and_grad's own scalars in d9d train's step (the grad seed, the token count), which
# the formula, read off a bare forward and loss, leaves out.
STEP_SCALARS = 16

FORMULA_LAYOUTS = [
    ("llama", {}, "none"),
    ("llama", {"fsdp": 2}, "selective"),
    ("llama", {"tp": 2}, "none"),
    ("llama", {"dp": 2, "tp": 2}, "full"),
    ("llama", {"fsdp": 2, "tp": 2}, "selective"),
    ("moe", {}, "none"),
    ("moe", {"fsdp": 2}, "none"),
]


@pytest.mark.parametrize(("family", "axes", "policy"), FORMULA_LAYOUTS)
def test_meta_measurement_equals_the_formula(family: str, axes: dict, policy: str) -> None:
    config = MOE_CONFIG if family == "moe" else CONFIG
    build = (lambda: MoE(config)) if family == "moe" else (lambda: Llama(config))
    measured = _meta_kept(build, family, axes, policy)
    layout = ActivationLayout(batch=BATCH, seq=SEQ, tp=axes.get("tp", 1), remat=policy)
    formula = (moe_activation_bytes if family == "moe" else activation_bytes)(config, layout)
    print(f"{family} {axes} {policy}: formula {formula:,} B, meta {measured:,} B")
    if family == "moe":  # the MoE formula is within 0.02% of KeptBytes (docs/plan.md)
        assert abs(measured - formula) <= 0.0002 * measured
    else:
        assert 0 <= measured - formula <= STEP_SCALARS


def _real_kept(
    build: Callable[[], torch.nn.Module],
    family: str,
    axes: dict,
    vocab: int,
    *,
    hf: bool = False,
    microbatches: int = 1,
    flags: StepFlags | None = None,
) -> int:
    """KeptBytes at the first backward op of rank 0 running d9d train's step on gloo ranks
    (``hf``: a Hugging Face model, whose output's logits the loss takes; ``flags``: d9d
    train's precision flags)."""

    def rank() -> int:
        torch.manual_seed(0)
        model = d9d.functionalize(build())
        path = Path("config.json") if hf else None  # _step only reads whether it is given
        step_flags = flags or StepFlags()
        step, opt = plan_step(
            model, _sizes(axes), family, path, "none", "1f1b", microbatches, step_flags
        )
        params, state = place_as_trained(step, opt, model, step_flags)
        shape = (BATCH * microbatches, SEQ)
        tokens = torch.randint(0, vocab, shape, generator=torch.Generator())
        batch = {"tokens": tokens, "labels": tokens}
        with KeptBytes((params, state, batch)) as kept:
            step(params, state, batch)
        return kept.before_backward

    return run_on_ranks(rank, math.prod(axes.values()), method="fork")[0]


# Three blocks, so that the plan measures models of one and two and extrapolates; every
# width differs from the others, the kv heads are fewer, and Qwen2's q/k/v have biases.
QWEN2 = {
    "model_type": "qwen2", "vocab_size": 300, "hidden_size": 96, "intermediate_size": 200,
    "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}  # fmt: skip


def test_meta_reads_back_what_ordinary_data_would() -> None:
    # Every check passes: no id out of range (any() is False), every position in order
    # (all() is True: transformers' packed-sequence check, which would otherwise build a mask).
    x = torch.zeros(2, 5, device="meta")
    with meta_as_cpu():
        assert bool((x < 0).any()) is False
        assert bool((x == 0).all()) is True
        assert int(x.sum()) == 0


@pytest.mark.parametrize("axes", [{"fsdp": 2}, {"tp": 2}], ids=["fsdp=2", "tp=2"])
def test_plan_of_a_hugging_face_model_equals_a_real_step(axes: dict, tmp_path: Path) -> None:
    import transformers

    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2))
    fields = {k: v for k, v in QWEN2.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model("qwen2", **fields)
    build = lambda: transformers.AutoModelForCausalLM.from_config(config)  # noqa: E731
    real = _real_kept(build, "llama", axes, QWEN2["vocab_size"], hf=True)
    sizes = _sizes(axes)
    with fake_world(math.prod(sizes.values())):
        model, _, _ = build_model("llama", "", path)
        step, opt = plan_step(model, sizes, "llama", path, "none", "1f1b", 1)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        tokens = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
        batch = {"tokens": tokens, "labels": tokens}
        planned = measure(model, step, params, state, batch, None, "llama", "", path, sizes,
                           "none", "1f1b", 1)  # fmt: skip
        whole = dry_run(step, params, state, batch)
    print(f"qwen2 {axes}: plan {planned.kept:,} B, real {real:,} B")
    assert planned.kept == whole.kept == real
    assert planned.comms.count == whole.comms.count and planned.comms.bytes == whole.comms.bytes
    text = show_plan(hf_config=path, seq=SEQ, batch=BATCH, max_rows=2, **axes)
    assert f"activations  {human(real):>12}  (measured on meta: batch 2 x seq 48" in text


def test_plan_of_master_weights_counts_the_bfloat16_activations_of_a_real_step() -> None:
    """``--master-weights`` computes the blocks in bfloat16, which the float32 formula does not
    count (1,167,564 B for the tiny Llama's 972,252 here), so the plan measures on meta."""
    real = _real_kept(
        lambda: Llama(LlamaConfig.tiny()),
        "llama",
        {"fsdp": 2},
        LlamaConfig.tiny().vocab_size,
        flags=StepFlags(master_weights=True),
    )
    text = show_plan("tiny", fsdp=2, seq=SEQ, batch=BATCH, master_weights=True, max_rows=2)
    assert f"activations  {human(real):>12}  (measured on meta: batch 2 x seq 48" in text, text
    formula = activation_bytes(LlamaConfig.tiny(), ActivationLayout(batch=BATCH, seq=SEQ))
    assert real < formula  # the float32 step's


def test_plan_of_the_moe_decoder_under_tensor_parallelism_equals_a_real_step() -> None:
    build = lambda: MoE(MOE_CONFIG)  # noqa: E731
    measured = _meta_kept(build, "moe", {"tp": 2}, "none")
    real = _real_kept(build, "moe", {"tp": 2}, MOE_CONFIG.vocab_size)
    print(f"moe tp=2: meta {measured:,} B, real {real:,} B")
    assert measured == real


def test_plan_under_pipeline_parallelism_equals_a_real_pipelined_step() -> None:
    """pp=2, 1F1B, 4 microbatches: rank 0 (the embedding and 2 of 4 blocks) holds 2
    microbatches in flight at its first backward (``in_flight``), as the formula counts them,
    and the schedule's buffers: a receive buffer for the grad of each microbatch's output and
    each microbatch's index (int64)."""
    config = LlamaConfig.small(
        n_layers=4, vocab_size=300, dim=128, n_heads=4, n_kv_heads=2, ffn_dim=200
    )
    build = lambda: Llama(config)  # noqa: E731
    measured = _meta_kept(build, "llama", {"pp": 2}, "none", microbatches=4)
    real = _real_kept(build, "llama", {"pp": 2}, config.vocab_size, microbatches=4)
    layout = ActivationLayout(
        batch=BATCH, seq=SEQ, blocks=2, last=False, microbatches=in_flight("1f1b", 4, 2, 0)
    )
    formula = activation_bytes(config, layout)
    buffers = 4 * (BATCH * SEQ * config.dim * 4 + 8)
    print(
        f"pp=2: formula {formula:,} B + buffers {buffers:,} B, meta {measured:,} B, real {real:,} B"
    )
    assert measured == real == formula + buffers


def test_moe_with_several_dense_blocks_under_pipeline_parallelism_is_measured_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepSeek-V3's three dense blocks: the small models of one block a stage would put one
    in stage 1 and count it as what every added block costs (and could not hold three)."""

    def extrapolated(*args: object, **kwargs: object) -> None:
        raise AssertionError("the plan measured blocks and extrapolated")

    monkeypatch.setattr(_measured_step, "_per_block", extrapolated)
    text = show_plan("deepseek-v3", model="moe", pp=2, seq=64, max_rows=1)
    assert re.search(r"activations +[\d.]+ GiB  \(measured on meta at rank 0's first backw", text)


def test_moe_under_pipeline_parallelism_counts_rank_0s_collectives() -> None:
    """The MoE's aux outputs come from the last stage, which rank 0 does not hold: its dry
    run makes their structure itself, so the bytes kept are measured and the collectives
    counted (equal to a real step's: ``test_plan_command.py``)."""
    text = show_plan("tiny", model="moe", pp=2, seq=32, max_rows=2)
    assert "not counted" not in text and re.search(r"send +│ pp +│ +12 │", text)
    assert re.search(
        r"activations +[\d.]+ [KM]iB  \(measured on meta at rank 0's first backw", text
    )


def _moe_pipelined_dry_run(schedule: str, microbatches: int) -> tuple[DryRun, list[str]]:
    """The dry run of the MoE decoder (one dense block, three MoE blocks: two stages a rank
    under the interleaved schedule) under pp=2, and the kinds of the stage compute spans it
    ran (``F``, ``B``, ``W``)."""
    sizes = _sizes({"pp": 2})
    with fake_world(2):
        with torch.device("meta"):
            model = d9d.functionalize(MoE(dataclasses.replace(MOE_CONFIG, n_layers=4)))
        step, opt = plan_step(model, sizes, "moe", None, "none", schedule, microbatches)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        tokens = torch.zeros(BATCH * microbatches, SEQ, dtype=torch.long, device="meta")
        with stage_spans() as spans:
            run = dry_run(step, params, state, {"tokens": tokens, "labels": tokens})
    return run, [kind for kind, stage, *_ in spans if stage >= 0]


def _whole_schedule(
    schedule: Any, shapes: Any, layout: Any, count: int, zero_bubble: bool, **step_kwargs: Any
) -> None:
    """``run_sampled``'s stand-in: the whole schedule, counted as it runs."""
    del shapes, layout, zero_bubble
    schedule.step(mb=torch.arange(count), **step_kwargs)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"])
def test_a_sampled_pipelined_dry_run_counts_what_the_whole_schedule_does(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 cannot receive the MoE's aux outputs on meta, so its dry run stops once each
    of its stages has run each action (F, B, W) once and counts the schedule from those:
    the same collectives, sends and receives, and bytes kept as running the whole schedule.
    Under zbv rank 0 holds the last stage, and samples too (for speed)."""
    fast, kinds = _moe_pipelined_dry_run(schedule, 4)
    monkeypatch.setattr(pipeline_executor, "run_sampled", _whole_schedule)
    whole, whole_kinds = _moe_pipelined_dry_run(schedule, 4)
    print(f"{schedule}: spans {kinds} of {whole_kinds}; kept {fast.kept:,} B")
    assert len(kinds) < len(whole_kinds)
    stages = 1 if schedule == "1f1b" else 2  # rank 0's
    assert whole_kinds.count("F") == whole_kinds.count("B") == 4 * stages
    assert fast.comms is not None and whole.comms is not None
    assert dict(fast.comms.count) == dict(whole.comms.count)
    assert dict(fast.comms.bytes) == dict(whole.comms.bytes)
    assert fast.kept == whole.kept is not None


def test_plan_of_the_pipelined_moe_decoder_equals_a_real_pipelined_step() -> None:
    """pp=2, 1F1B, 4 microbatches: the bytes the dry run measures before it stops (it cannot
    receive the aux outputs) are those of rank 0 of gloo ranks running the whole step."""
    build = lambda: MoE(MOE_CONFIG)  # noqa: E731
    measured = _meta_kept(build, "moe", {"pp": 2}, "none", microbatches=4)
    real = _real_kept(build, "moe", {"pp": 2}, MOE_CONFIG.vocab_size, microbatches=4)
    print(f"moe pp=2: meta {measured:,} B, real {real:,} B")
    assert measured == real


def test_the_plan_of_a_pipelined_moe_is_the_one_the_whole_schedule_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``d9d plan``'s whole report (table, memory per rank, activations, collectives) is
    the same whether the dry run samples each stage action once or runs the schedule to
    its end."""
    options = dict(model="moe", pp=2, ep=2, fsdp=2, seq=32, microbatches=4, max_rows=None)
    fast = show_plan("tiny", **options)
    monkeypatch.setattr(pipeline_executor, "run_sampled", _whole_schedule)
    assert show_plan("tiny", **options) == fast
    assert "ep:S(0)" in fast and "measured on meta at rank 0's first backward" in fast
    assert re.search(r"all_reduce +│ ep ", fast) and "not counted" not in fast
