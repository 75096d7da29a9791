"""``d9d train --fp8 RECIPE``: the blocks' linears (and a MoE's routed experts) compute in fp8;
the losses stay near the float32 run's and the checkpointed params stay float32."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from d9d.cli import main


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
