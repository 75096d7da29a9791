"""``d9d train --fp8 RECIPE``: the blocks' linears (and a MoE's routed experts) compute in fp8;
the losses stay near the float32 run's and the checkpointed params stay float32."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from d9d.cli import main
from d9d.cli.plan._show import show_plan


@pytest.fixture(autouse=True)
def _fresh_sharding_cache() -> Iterator[None]:
    """The runs place DTensors on a one-rank world of their own (see test_train_precision)."""
    yield
    _clear_sharding_prop_cache()


def _run(out: Path, *extra: str) -> list[float]:
    argv = ["train", "--steps", "3", "--batch-size", "4", "--seq-len", "32", "--out", str(out)]
    assert main([*argv, "--no-tensorboard", *extra]) == 0
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_fp8_run_stays_near_the_float32_run(tmp_path: Path) -> None:
    plain = _run(tmp_path / "plain")
    fp8 = _run(tmp_path / "fp8", "--fp8", "rowwise", "--save-every", "3")
    assert fp8 != plain  # computed in fp8 ...
    torch.testing.assert_close(torch.tensor(fp8), torch.tensor(plain), rtol=1e-2, atol=0)
    config = json.loads((tmp_path / "fp8/config.json").read_text())
    assert config["fp8"] == "rowwise"
    leaves = json.loads((tmp_path / "fp8/checkpoints/step_3/metadata.json").read_text())["leaves"]
    dtypes = {leaf["dtype"] for path, leaf in leaves.items() if path.startswith("params.")}
    assert dtypes == {"float32"}  # ... over float32 params


def test_fp8_moe_run_stays_near_the_float32_run(tmp_path: Path) -> None:
    """``--model moe``: the routed experts' grouped GEMMs compute in fp8 too."""
    plain = _run(tmp_path / "plain", "--model", "moe")
    fp8 = _run(tmp_path / "fp8", "--model", "moe", "--fp8", "tensorwise")
    assert fp8 != plain
    torch.testing.assert_close(torch.tensor(fp8), torch.tensor(plain), rtol=1e-2, atol=0)


def test_unknown_recipe_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--out", str(tmp_path / "run"), "--fp8", "mxfp8"])
    assert exit_.value.code == 2
    assert "argument --fp8: invalid choice: 'mxfp8'" in capsys.readouterr().err


def test_fp8_exclude_keeps_the_matched_linears_in_high_precision(tmp_path: Path) -> None:
    """``--fp8-exclude attn mlp`` (either pattern) leaves no linear of the blocks in fp8: the
    run is the plain run, bitwise; with ``--fp8-exclude mlp`` the attention computes in fp8."""
    plain = _run(tmp_path / "plain", "--steps", "2")
    args = ("--steps", "2", "--fp8", "rowwise", "--fp8-exclude")
    assert _run(tmp_path / "none", *args, "attn", "mlp") == plain
    assert _run(tmp_path / "attn", *args, "mlp") != plain
    config = json.loads((tmp_path / "none/config.json").read_text())
    assert config["fp8_exclude"] == ["attn", "mlp"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fp8-exclude", "attn"], r"--fp8-exclude chooses what --fp8 computes in fp8; pass"),
        (["--fp8-gather"], r"--fp8-gather chooses what --fp8 computes in fp8; pass --fp8"),
        (["--fp8", "rowwise", "--fp8-gather"], r"--fp8-gather all-gathers tensorwise .*rowwise"),
        (
            ["--fp8", "tensorwise", "--fp8-gather", "--steps", "1", "--batch-size", "2"],
            r"--fp8-gather all-gathers the fp8 weights of --fsdp ranks under --zero 3, and this "
            r"run has --fsdp 1",
        ),
    ],
)
def test_fp8_options_without_their_recipe_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["train", "--out", str(tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


def test_plan_takes_the_fp8_flags() -> None:
    """``d9d plan --fp8 tensorwise --fp8-exclude wo``: the fp8 column shows the choice; with
    ``--fp8-gather`` the fp8 weights' amaxes are all-reduced once, as the step starts."""
    options = {"fsdp": 2, "seq": 32, "max_rows": None, "fp8": "tensorwise"}
    text = show_plan("tiny", **options, fp8_exclude=("wo",))
    cells = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in text.splitlines()
        if line.count("│") > 3
    }
    assert cells["layers.0.attn.wq.weight"] == "tensorwise"
    assert cells["layers.0.attn.wo.weight"] == "-"
    gathered = show_plan("tiny", **options, fp8_exclude=("wo",), fp8_gather=True)
    # One all-reduce of every fp8 weight's amax a step, however often the 2 blocks are
    # gathered (for the forward, and again for the backward).
    assert _count(gathered, "all_reduce") - _count(text, "all_reduce") == 1
    with pytest.raises(ValueError, match=r"--fp8-exclude chooses what --fp8 computes"):
        show_plan("tiny", fsdp=2, fp8_exclude=("wo",))


def _count(text: str, kind: str) -> int:
    """The count column of ``kind``'s row in the plan's collectives table."""
    (row,) = [line for line in text.splitlines() if line.startswith(f"│ {kind} ")]
    return int(row.split("│")[3])
