"""``d9d plan``: every axis, human units, activations, collectives (against a real pipelined
step too), large worlds, errors."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import d9d
from d9d.cli import main
from d9d.cli.plan import _measured_step
from d9d.cli.plan._dry_run import count_collectives, dry_run
from d9d.cli.plan._measured_step import _per_block, _uniform, measure, pipeline_layout, plan_step
from d9d.cli.plan._models import build_model
from d9d.cli.plan._report import human
from d9d.cli.plan._show import show_plan
from d9d.errors import DryRunError
from d9d.models import Llama, LlamaConfig, MoE, MoEConfig
from d9d.testing import fake_world, run_on_ranks

pytestmark = pytest.mark.distributed


def test_human_units() -> None:
    assert human(512) == "512 B"
    assert human(3 * 2**20) == "3.00 MiB"
    assert human(int(2.5 * 2**30)) == "2.50 GiB"


def test_plan_of_every_axis_shows_memory_activations_and_collectives() -> None:
    text = show_plan("small", dp=2, fsdp=2, tp=2, cp=2, seq=64, remat="full", max_rows=4)
    assert text.splitlines()[0] == (
        "d9d plan: llama small (3.03 M params) on 16 simulated ranks: dp=2 x fsdp=2 x cp=2 x tp=2"
    )
    for line in ("  params ", "  grads ", "  optimizer ", "  activations ", "  total "):
        assert line in text
    assert "remat full" in text and " MiB" in text and " KiB" in text
    for kind_axis in ("all_gather     │ fsdp", "all_to_all     │ cp", "all_reduce     │ dp"):
        assert kind_axis in text
    assert "reduce_scatter │ tp" in text


def test_expert_parallel_plan_counts_uniform_dispatch_and_combine() -> None:
    """moe tiny on ep=2, 1 x 64 tokens top-2 of 6 experts (3 a rank), width 64, float32,
    uniform routing: a token reaches the other rank unless both its experts are here,
    64 x (1 - C(3, 2) / C(6, 2)) = 51.2, so 51 tokens leave and 51 come in. The counts
    (2 x 4 int64), forward and backward the 51 tokens out and 51 rows back (4 x 51 x 64 x 4
    B), their ids out (51 x 2 int32), their weights out and the weights' grads back (2 x 51
    x 2 x 4 B): 64 + 52,224 + 408 + 816 = 53,512 B = 52.26 KiB in 8 all-to-alls."""
    text = show_plan("tiny", model="moe", ep=2, seq=64, max_rows=None)
    assert text.splitlines()[0].endswith("on 2 simulated ranks: ep=2")
    assert (
        "│ layers.1.mlp.experts.w_gate       │ [6, 64, 40] │ float32 │ ep:S(0) │ ep:S(0) │" in text
    )
    assert "│ all_to_all │ ep   │     8 │  52.26 KiB │" in text
    assert "dispatch and combine for uniform routing" in text


def test_pipeline_plan_names_rank_0s_stage_and_counts_its_sends() -> None:
    """pp=2 x fsdp=2, 4 microbatches of 1 x 64 tokens of width 256 (float32): rank 0 runs
    stage 0, sends 4 activations of 64 KiB forward and receives their 4 grads back."""
    text = show_plan("small", pp=2, fsdp=2, seq=64, max_rows=None)
    assert "19 of 39 params held by rank 0" in text
    assert (
        "pipeline: rank 0 runs stage 0 (embed, layers.0 .. layers.1) of 2 stages on 2 ranks; "
        "schedule 1f1b, 4 microbatches of 1 x 64 tokens"
    ) in text
    activation = 1 * 64 * 256 * 4
    for kind in ("send", "recv"):
        assert f"{kind:<14} │ pp   │     4 │ 256.00 KiB" in text
        assert f"  {kind} on pp: 4 tensors, each a microbatch's activation" in text
        assert f"{activation:,} B each; {4 * activation:,} B in all" in text
    assert "all_gather     │ fsdp │     1" in text and "not counted" not in text


def test_pipeline_plan_of_zero_2_keeps_the_stage_whole_and_reduces_it_once() -> None:
    """pp=2 x fsdp=2 with --zero 2, tiny Llama in float32: rank 0 holds its stage (the
    embedding and layers.0: two norms, wq, wo, wk, wv, three MLP weights) whole, keeps
    half of its grads, and per step reduce-scatters them once and all-gathers the updated
    params once."""
    text = show_plan("tiny", pp=2, fsdp=2, zero=2, seq=64, max_rows=0)
    stage = (256 * 64 + 2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 176 * 64) * 4
    assert "memory on rank 0 (AdamW, float32, ZeRO-2 over fsdp):" in text
    assert f"  params         {human(stage)}" in text
    assert f"  grads          {human(stage // 2)}" in text
    for kind in ("all_gather    ", "reduce_scatter"):
        assert f"{kind} │ fsdp │     1 │ {human(stage)} │" in text


def test_collectives_from_two_sizes_of_model_equal_the_whole_model_counted() -> None:
    sizes = {"pp": 1, "dp": 1, "fsdp": 2, "cp": 1, "tp": 2}
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    batch = {"tokens": tokens, "labels": tokens}
    with fake_world(4):
        model, config, _ = build_model("llama", "small", None)
        step, opt = plan_step(model, sizes, "llama", None, "none", "1f1b", 1)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        whole = count_collectives(step, params, state, batch)
        parts = _per_block(config, "llama", "small", sizes, "none", "1f1b", 1, batch).comms
    assert dict(parts.count) == dict(whole.count)
    assert dict(parts.bytes) == dict(whole.bytes)


def _sizes(**axes: int) -> dict[str, int]:
    return {"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "tp": 1, **axes}


def _plan_comms(
    preset: str,
    sizes: dict[str, int],
    schedule: str,
    microbatches: int,
    n_layers: int,
    family: str = "llama",
) -> tuple[dict, dict, bool, int]:
    """``d9d plan``'s collectives of a layout (as ``show_plan`` counts them: extrapolated
    past a few blocks), whether they were extrapolated, and the bytes kept for the
    backward (extrapolated alike)."""
    tokens = torch.zeros(2 * microbatches, 32, dtype=torch.long, device="meta")
    batch = {"tokens": tokens, "labels": tokens}
    with fake_world(math.prod(sizes.values())):
        model, config, _ = build_model(family, preset, None, n_layers=n_layers)
        step, opt = plan_step(model, sizes, family, None, "none", schedule, microbatches)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        layout = pipeline_layout(step)
        held = sum(b - a for a, b in (layout.split.blocks[s] for s in layout.local_stages))
        measured = measure(
            model, step, params, state, batch, config, family, preset, None, sizes, "none",
            schedule, microbatches,
        )  # fmt: skip
    stats, extrapolated = measured.comms, held > len(layout.local_stages) + 1
    return dict(stats.count), dict(stats.bytes), extrapolated, measured.kept


PIPELINE_LAYOUTS = {
    # name: (preset, sizes, schedule, microbatches, blocks)
    "pp=2 1f1b": ("tiny", _sizes(pp=2), "1f1b", 4, 6),
    "pp=2 interleaved_1f1b": ("tiny", _sizes(pp=2), "interleaved_1f1b", 4, 8),
    "pp=2 zbv x tp=2": ("tiny", _sizes(pp=2, tp=2), "zbv", 4, 8),
    "pp=2 dualpipev x tp=2": ("tiny", _sizes(pp=2, tp=2), "dualpipev", 4, 8),
    "pp=2 x fsdp=2": ("tiny", _sizes(pp=2, fsdp=2), "1f1b", 2, 6),
    "pp=4 gpipe x fsdp=2 x tp=2": ("tiny", _sizes(pp=4, fsdp=2, tp=2), "gpipe", 4, 12),
    "pp=2 interleaved_zb, tied": ("1b", _sizes(pp=2, fsdp=4), "interleaved_zb", 4, 8),
}


@pytest.mark.parametrize("name", list(PIPELINE_LAYOUTS))
def test_pipeline_collectives_from_small_models_equal_the_whole_model_counted(name: str) -> None:
    """Under pp the step is counted on models whose stages hold one block, then one more in
    each of rank 0's stages; rank 0's blocks past those move and keep what the added one of
    their stage does (under the interleaved and zero-bubble schedules rank 0's two stages
    keep different numbers of microbatches in flight)."""
    preset, sizes, schedule, microbatches, n_layers = PIPELINE_LAYOUTS[name]
    tokens = torch.zeros(2 * microbatches, 32, dtype=torch.long, device="meta")
    batch = {"tokens": tokens, "labels": tokens}
    with fake_world(math.prod(sizes.values())):
        model, _, _ = build_model("llama", preset, None, n_layers=n_layers)
        step, opt = plan_step(model, sizes, "llama", None, "none", schedule, microbatches)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        whole = dry_run(step, params, state, batch)
    count, nbytes, extrapolated, kept = _plan_comms(preset, sizes, schedule, microbatches, n_layers)
    assert extrapolated
    assert count == dict(whole.comms.count)
    assert nbytes == dict(whole.comms.bytes)
    assert kept == whole.kept


def _real_step_comms(
    sizes: dict[str, int], schedule: str, microbatches: int, n_layers: int
) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=n_layers)))
    step, opt = plan_step(model, sizes, "llama", None, "none", schedule, microbatches)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    tokens = torch.randint(0, 256, (2 * microbatches, 32))
    stats = step.comms(params, state, {"tokens": tokens, "labels": tokens})
    return dict(stats.count), dict(stats.bytes)


# Rank 0's sends per microbatch (activations forward, grads back) and the bytes of each:
# batch 2 x 32 tokens x width 64 x 4 bytes, half the tokens under tp's sequence parallelism.
REAL_LAYOUTS = {
    "pp=2 1f1b": ("pp=2 1f1b", 1, 2 * 32 * 64 * 4),  # stage 0 of 2
    "pp=2 interleaved_1f1b": ("pp=2 interleaved_1f1b", 3, 2 * 32 * 64 * 4),  # 0, 2 of 4
    "pp=2 zbv x tp=2": ("pp=2 zbv x tp=2", 2, 2 * 16 * 64 * 4),  # stages 0 and 3 of 4
    "pp=2 dualpipev x tp=2": ("pp=2 dualpipev x tp=2", 2, 2 * 16 * 64 * 4),  # the same V
    "pp=2 x fsdp=2": ("pp=2 x fsdp=2", 1, 2 * 32 * 64 * 4),
}


@pytest.mark.parametrize("name", list(REAL_LAYOUTS))
def test_plan_collectives_equal_a_real_pipelined_step(name: str) -> None:
    """``d9d plan``'s figures for rank 0 equal what ``step.comms`` counts on rank 0 of gloo
    ranks running the same step (``d9d train``'s, AdamW with clipping) on real tensors:
    every collective and every send and receive between stages, count and bytes."""
    layout, per_microbatch, activation = REAL_LAYOUTS[name]
    preset, sizes, schedule, microbatches, n_layers = PIPELINE_LAYOUTS[layout]
    count, nbytes, extrapolated, _ = _plan_comms(preset, sizes, schedule, microbatches, n_layers)
    ranks = math.prod(sizes.values())
    real = run_on_ranks(
        _real_step_comms, ranks, sizes, schedule, microbatches, n_layers, method="fork"
    )
    assert extrapolated
    assert (count, nbytes) == real[0]
    for kind in ("send", "recv"):
        assert count[(kind, "pp")] == per_microbatch * microbatches
        assert nbytes[(kind, "pp")] == per_microbatch * microbatches * activation


def _real_moe_step_comms(
    sizes: dict[str, int], schedule: str, microbatches: int, n_layers: int
) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = d9d.functionalize(MoE(MoEConfig.tiny(n_layers=n_layers)))
    step, opt = plan_step(model, sizes, "moe", None, "none", schedule, microbatches)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    tokens = torch.randint(0, 256, (2 * microbatches, 32))
    stats = step.comms(params, state, {"tokens": tokens, "labels": tokens})  # the rank's own
    return dict(stats.count), dict(stats.bytes)


MOE_LAYOUTS = {
    # name: (sizes, schedule, microbatches, blocks); MoEConfig.tiny: block 0 dense
    "pp=2 1f1b": (_sizes(pp=2), "1f1b", 4, 4),
    "pp=2 interleaved_1f1b": (_sizes(pp=2), "interleaved_1f1b", 4, 6),
    "pp=2 interleaved_zb x fsdp=2": (_sizes(pp=2, fsdp=2), "interleaved_zb", 4, 4),
    "pp=2 x tp=2": (_sizes(pp=2, tp=2), "1f1b", 2, 4),
    "pp=2 x ep=2": ({**_sizes(pp=2), "ep": 2}, "1f1b", 2, 4),
    "pp=2 zbv x ep=2": ({**_sizes(pp=2), "ep": 2}, "zbv", 4, 4),  # rank 0 holds the last stage
}


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_plan_collectives_of_a_pipelined_moe_equal_a_real_step(name: str) -> None:
    """The MoE's aux outputs come from the last stage, which rank 0 does not hold (but
    under zbv): its dry run counts one microbatch of each stage action and makes the aux
    outputs' structure itself. Every count and byte equals ``step.comms`` on rank 0 of gloo ranks running the
    whole step, but the all-to-all bytes on ep, which follow the real step's routing (the
    plan's are uniform routing's: ``test_expert_parallel_plan_counts_uniform_...``)."""
    sizes, schedule, microbatches, n_layers = MOE_LAYOUTS[name]
    count, nbytes, _, _ = _plan_comms("tiny", sizes, schedule, microbatches, n_layers, "moe")
    ranks = math.prod(sizes.values())
    real = run_on_ranks(
        _real_moe_step_comms, ranks, sizes, schedule, microbatches, n_layers, method="fork"
    )[0]
    routed = ("all_to_all", "ep")
    assert count == real[0]
    assert {k: v for k, v in nbytes.items() if k != routed} == {
        k: v for k, v in real[1].items() if k != routed
    }
    assert count[("send", "pp")] > 0 and count[("all_reduce", "pp")] > 0
    assert ("ep" in sizes) == (count.get(routed, 0) > 0)  # rank 0 holds MoE block 1


def test_plan_prints_the_pipeline_figures_of_a_real_step() -> None:
    """The text: tiny (2 blocks) on pp=2 x fsdp=2, 2 microbatches of 2 x 32 tokens."""
    text = show_plan("tiny", pp=2, fsdp=2, batch=2, seq=32, microbatches=2, max_rows=4)
    count, nbytes = run_on_ranks(
        _real_step_comms, 4, _sizes(pp=2, fsdp=2), "1f1b", 2, 2, method="fork"
    )[0]
    for (kind, axis), n in count.items():
        assert re.search(
            rf"{kind} +│ {axis} +│ +{n} │ +{re.escape(human(nbytes[(kind, axis)]))}", text
        )
    sent = nbytes[("send", "pp")]
    assert "send on pp: 2 tensors, each a microbatch's activation (forward) or its grad" in text
    assert f"{sent // 2:,} B each; {sent:,} B in all" in text


def test_dry_run_of_a_pipeline_rank_without_stage_0_is_refused() -> None:
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    with fake_world(2, rank=1):
        model, _, _ = build_model("llama", "tiny", None)
        step, opt = plan_step(model, _sizes(pp=2), "llama", None, "none", "1f1b", 2)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        with pytest.raises(
            DryRunError,
            match=r"pipeline rank 1 runs on meta tensors .* only the rank holding stage 0 "
            r"\(pipeline rank 0\) can run on meta",
        ):
            count_collectives(step, params, state, {"tokens": tokens, "labels": tokens})


def test_8b_on_1024_simulated_ranks_builds() -> None:
    text = show_plan("8b", dp=8, fsdp=16, tp=8, seq=8192, max_rows=4)
    assert "on 1024 simulated ranks: dp=8 x fsdp=16 x tp=8" in text
    assert "all_gather     │ tp" in text and "GiB" in text
    # HSDP's grads are all-reduced over dp once per unit (was once per param: 291 + 3):
    # 32 blocks and the params outside them, then the grad norm, the loss and its tokens.
    assert "all_reduce     │ dp   │    36 │" in text


def test_hugging_face_config(tmp_path: Path) -> None:
    config = {
        "model_type": "llama",
        "vocab_size": 97,
        "hidden_size": 48,
        "intermediate_size": 100,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    text = show_plan(hf_config=path, fsdp=2, tp=2, seq=32, max_rows=None)
    assert "LlamaForCausalLM" in text and "model.layers.0.self_attn.q_proj.weight" in text
    assert "tp:S(0)" in text and "(measured on meta: batch 1 x seq 32 per microbatch" in text
    assert "reduce_scatter │ fsdp" in text


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--preset", "tiny"], "--preset tiny is"),
        (["--model", "moe"], "--model moe is"),
        (["--preset", "tiny", "--model", "moe"], "--preset tiny and --model moe are"),
        (["--preset", "8b"], "--preset 8b is"),  # the default, given: was ignored unseen
        (["--model", "llama"], "--model llama is"),
    ],
)
def test_a_preset_or_model_beside_a_hugging_face_config_is_refused(
    flags: list[str], named: str, tmp_path: Path, capsys
) -> None:
    """The config.json names the model: a --preset or --model beside it was ignored."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 48}))
    assert main(["plan", "--hf-config", str(path), *flags]) == 2
    assert capsys.readouterr().err.startswith(
        f"d9d plan: error: {named} not read with --hf-config, whose config.json names the model"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3"], r"dim 0 \(heads, 64\) does not divide over 3 'tp' ranks"),
        (["--world", "8", "--fsdp", "3"], r"is 3 ranks, not --world 8"),
        (["--world", "6", "--tp", "4"], r"--world 6 does not split into .* = 4 ranks"),
        (["--preset", "9b"], r"name='9b'; valid presets are"),
        (["--ep", "2"], r"--ep 2 shards the routed experts of d9d's MoE model: pass --model moe"),
        (["--dp", "0"], r"--dp must be an int >= 1, got 0"),
        (["--pp", "2", "--microbatches", "0"], r"--microbatches must be an int >= 1, got 0"),
        (
            ["--pp", "2", "--microbatches", "1"],
            r"pipeline\(schedule='1f1b'\) cannot run 1 microbatches on 2 ranks",
        ),
        (["--hf-config", "/no/such/config.json"], r"'/no/such/config.json' is not a file"),
    ],
)
def test_bad_layouts_are_named(argv: list[str], message: str, capsys) -> None:
    assert main(["plan", "--preset", "tiny", "--seq", "64", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("d9d plan: error: ")
    assert re.search(message, err), err


def test_plan_prints_no_warning_of_torch_internals_before_its_table(capfd) -> None:
    """c10 printed ``[rank0]:[W...] ProcessGroup.hpp ... No backend of type 0 found`` first."""
    assert main(["plan", "--preset", "tiny", "--seq", "64", "--fsdp", "2"]) == 0
    out, err = capfd.readouterr()
    assert out.startswith("d9d plan: llama tiny") and "[W" not in err, err


@pytest.mark.parametrize("axes", [{"fsdp": 2}, {"fsdp": 2, "tp": 2}], ids=["fsdp=2", "fsdp=2xtp=2"])
def test_plan_collectives_equal_a_real_step(axes: dict[str, int]) -> None:
    """Without --pp too, the figures equal ``step.comms`` on rank 0 of gloo ranks: the
    forward's gathers, and the backward's (``shard_params`` drops gathered params after the
    forward and gathers them again, which the dry run on meta does as a real step does)."""
    sizes = _sizes(**axes)
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    batch = {"tokens": tokens, "labels": tokens}
    with fake_world(math.prod(sizes.values())):
        model, config, _ = build_model("llama", "tiny", None, n_layers=3)
        step, opt = plan_step(model, sizes, "llama", None, "none", "1f1b", 1)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        stats = measure(
            model, step, params, state, batch, config, "llama", "tiny", None, sizes, "none",
            "1f1b", 1,
        ).comms  # fmt: skip
    real = run_on_ranks(_real_step_comms, math.prod(sizes.values()), sizes, "1f1b", 1, 3)
    assert (dict(stats.count), dict(stats.bytes)) == real[0]
    assert stats.count[("all_gather", "fsdp")] == 2 * 4  # embedding & head, 3 blocks; twice


def test_hugging_face_blocks_of_different_kinds_are_measured_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 2 alternates sliding-window and global attention (``layer_types``): one or two
    blocks do not stand for the rest, so the plan runs the whole model."""

    def extrapolated(*args: object, **kwargs: object) -> None:
        raise AssertionError("the plan measured blocks and extrapolated")

    monkeypatch.setattr(_measured_step, "_per_block", extrapolated)
    config = {
        "model_type": "gemma2", "vocab_size": 97, "hidden_size": 48, "intermediate_size": 100,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 12, "max_position_embeddings": 64, "sliding_window": 8,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    tokens = torch.zeros(1, 32, dtype=torch.long, device="meta")
    batch = {"tokens": tokens, "labels": tokens}
    with fake_world(2):
        model, _, _ = build_model("llama", "", path)
        step, opt = plan_step(model, _sizes(fsdp=2), "llama", path, "none", "1f1b", 1)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        planned = measure(
            model, step, params, state, batch, None, "llama", "", path, _sizes(fsdp=2), "none",
            "1f1b", 1,
        )  # fmt: skip
        whole = dry_run(step, params, state, batch)
    assert not _uniform(model)
    assert planned.kept == whole.kept and planned.comms.count == whole.comms.count


def test_microbatches_without_a_pipeline_are_refused() -> None:
    with pytest.raises(ValueError, match=r"--microbatches 4 splits the step over pipeline stages"):
        show_plan("tiny", fsdp=2, microbatches=4)


def test_a_schedule_without_a_pipeline_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--schedule zbv orders the microbatches of pipeline"):
        show_plan("tiny", fsdp=2, schedule="zbv")


def test_pipeline_plan_counts_the_accumulated_grads_instead_of_the_kept() -> None:
    """pp=2 x fsdp=2 (ZeRO-3): the stage's grads summed whole over its microbatches are twice
    its fsdp-sharded params, shown on their own line, and the total holds them, not grads."""
    text = show_plan("tiny", pp=2, fsdp=2, seq=32, max_rows=2)
    figures = dict(re.findall(r"^  (\w+) +([\d.]+ \w?i?B)", text, flags=re.M))
    assert "accumulated" in figures and "whole, summed over microbatches" in text
    unit = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    value = {k: float(v.split()[0]) * unit[v.split()[1]] for k, v in figures.items()}
    assert value["accumulated"] == pytest.approx(2 * value["params"], abs=0.01 * 2**10)
    parts = value["params"] + value["accumulated"] + value["optimizer"] + value["activations"]
    assert value["total"] == pytest.approx(parts, abs=0.005 * 2**20)  # total is in MiB
    assert (
        value["total"]
        > value["params"]
        + value["grads"]
        + value["optimizer"]
        + value["activations"]
        + 0.005 * 2**20
    )
