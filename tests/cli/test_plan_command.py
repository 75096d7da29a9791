"""``d9d plan``: every axis, human units, activations, collectives, large worlds, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from d9d.cli import main
from d9d.cli._plan_command import _per_block, _step, show_plan
from d9d.cli._plan_dry_run import count_collectives
from d9d.cli._plan_models import build_model
from d9d.cli._plan_report import human
from d9d.testing import fake_world

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


def test_pipeline_plan_holds_one_stage_and_says_collectives_are_not_counted() -> None:
    text = show_plan("small", pp=2, fsdp=2, seq=64, max_rows=None)
    assert "19 of 39 params held by rank 0" in text
    assert "collectives: not counted under --pp" in text


def test_collectives_from_two_sizes_of_model_equal_the_whole_model_counted() -> None:
    sizes = {"pp": 1, "dp": 1, "fsdp": 2, "cp": 1, "tp": 2}
    tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
    batch = {"tokens": tokens, "labels": tokens}
    with fake_world(4):
        model, config, _ = build_model("llama", "small", None)
        step, opt = _step(model, sizes, "llama", None, "none", "1f1b", 1)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        whole = count_collectives(step, params, state, batch)
        parts = _per_block(config, "llama", "small", sizes, "none", "1f1b", 1, batch)
    assert dict(parts.count) == dict(whole.count)
    assert dict(parts.bytes) == dict(whole.bytes)


def test_8b_on_1024_simulated_ranks_builds() -> None:
    text = show_plan("8b", dp=8, fsdp=16, tp=8, seq=8192, max_rows=4)
    assert "on 1024 simulated ranks: dp=8 x fsdp=16 x tp=8" in text
    assert "all_gather     │ tp" in text and "GiB" in text


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
    assert "tp:S(0)" in text and "activations           n/a" in text
    assert "reduce_scatter │ fsdp" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3"], r"dim 0 \(heads, 64\) does not divide over 3 'tp' ranks"),
        (["--world", "8", "--fsdp", "3"], r"is 3 ranks, not --world 8"),
        (["--world", "6", "--tp", "4"], r"--world 6 does not split into .* = 4 ranks"),
        (["--preset", "9b"], r"name='9b'; valid presets are"),
        (["--ep", "2"], r"--ep 2: expert_parallel is not built yet"),
        (["--dp", "0"], r"--dp must be an int >= 1, got 0"),
        (["--hf-config", "/no/such/config.json"], r"'/no/such/config.json' is not a file"),
    ],
)
def test_bad_layouts_are_named(argv: list[str], message: str, capsys) -> None:
    assert main(["plan", "--preset", "tiny", "--seq", "64", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("d9d plan: error: ")
    assert re.search(message, err), err
