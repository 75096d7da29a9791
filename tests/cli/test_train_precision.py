"""``d9d train --grad-accum N`` equals the run without it (the same global batch, one update
per step), and ``--dtype bfloat16`` computes in bf16 over float32 master weights."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from d9d.cli import main


@pytest.fixture(autouse=True)
def _fresh_sharding_cache() -> Iterator[None]:
    """The runs place DTensors on a one-rank world of their own: DTensor's sharding cache,
    keyed by mesh layout, is cleared after them (see ``d9d.testing.fake_world``)."""
    yield
    _clear_sharding_prop_cache()


def _run(out: Path, *extra: str) -> list[float]:
    argv = ["train", "--steps", "3", "--batch-size", "4", "--seq-len", "32", "--out", str(out)]
    assert main([*argv, "--no-tensorboard", *extra]) == 0
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grad_accum_and_bf16_equal_the_runs_they_stand_for(tmp_path: Path) -> None:
    plain = _run(tmp_path / "plain")
    # Two microbatches of 2 sequences: the grads of the 4-sequence batch, in another order.
    accumulated = _run(tmp_path / "accum", "--grad-accum", "2")
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(plain, accumulated, strict=True))

    bf16 = _run(tmp_path / "bf16", "--dtype", "bfloat16", "--save-every", "3")
    assert bf16 != plain  # computed in bf16 ...
    assert all(math.isclose(a, b, rel_tol=1e-2) for a, b in zip(plain, bf16, strict=True))
    leaves = json.loads((tmp_path / "bf16/checkpoints/step_3/metadata.json").read_text())["leaves"]
    dtypes = {leaf["dtype"] for path, leaf in leaves.items() if path.startswith("params.")}
    assert dtypes == {"float32"}  # ... over float32 master weights


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--grad-accum", "0"], r"--grad-accum must be >= 1, got 0"),
        (["--grad-accum", "2", "--pp", "2"], r"--grad-accum does not combine with --pp"),
        (["--dtype", "float16"], r"invalid choice: 'float16'"),
    ],
)
def test_bad_precision_flags_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    try:
        code = main(["train", "--out", str(tmp_path / "run"), *extra])
    except SystemExit as exit_:  # argparse's own choices
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
