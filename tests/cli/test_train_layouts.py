"""``d9d train`` with ``--tp``, ``--cp``, ``--pp``, ``--ep`` (and ``--dp``/``--fsdp``) on forked gloo
ranks gives the losses of the one-process run."""

from __future__ import annotations

import functools
import io
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from d9d.cli._config import TrainConfig
from d9d.cli.train import _run as _train
from d9d.cli.train._run import train
from d9d.errors import RankFailedError
from d9d.testing import run_on_ranks
from d9d.transforms.tensor_parallel import TensorParallel

pytestmark = pytest.mark.distributed

_RUN = {"steps": 4, "batch_size": 4, "seq_len": 32}


def _losses(out: Path, **layout: Any) -> list[float]:
    config = TrainConfig(out=out, **{**_RUN, **layout})
    return [r["loss"] for r in train(config, console=Console(file=io.StringIO())).records]


@functools.cache
def _one_process(model: str) -> list[float]:
    """The one-process run of ``model``, once per worker (its folder is thrown away)."""
    with tempfile.TemporaryDirectory() as tmp:
        return _losses(Path(tmp), model=model)


@pytest.mark.parametrize(
    "layout",
    [
        {"tp": 2},
        {"cp": 2},
        {"pp": 2},
        {"pp": 2, "schedule": "gpipe", "microbatches": 2, "fsdp": 2},
        {"dp": 2, "tp": 2},
        {"model": "moe", "tp": 2},  # sequence parallel: each rank routes half of each sequence
        {"model": "moe", "ep": 2},  # 3 of the 6 experts per rank
        {"fsdp": 2, "zero": 2},  # grads and optimizer state sharded, params whole
        {"dp": 2, "fsdp": 2, "zero": 1},  # optimizer state sharded over fsdp
        {"pp": 2, "microbatches": 2, "fsdp": 2, "zero": 2},  # ZeRO-2 inside each stage
    ],
    ids=lambda layout: ",".join(f"{k}={v}" for k, v in layout.items()),
)
def test_layout_trains_like_one_process(
    layout: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    expected = _one_process(layout.get("model", "llama"))
    world = math.prod(v for k, v in layout.items() if k in ("dp", "fsdp", "ep", "tp", "cp", "pp"))
    out = tmp_path_factory.mktemp("ranks")
    for losses in run_on_ranks(_losses, world, out, method="fork", timeout=300, **layout):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == _RUN["steps"]


def test_moe_runs_tensor_parallel_with_sequence_parallelism() -> None:
    def rank() -> list[bool]:
        step = _train._parallel(TrainConfig(model="moe", tp=2), lambda p, s, b: (p, s, {}))
        return [t.sequence_parallel for t in step.transforms if isinstance(t, TensorParallel)]

    assert run_on_ranks(rank, 2) == [[True], [True]]


def test_layout_must_fill_the_job(tmp_path: Path) -> None:
    with pytest.raises(
        RankFailedError,
        match=r"--pp 1 x --dp 1 x --ep 1 x --cp 1 x --tp 3 x --fsdp 1 "
        r"is 3 ranks but torchrun started 2",
    ):
        run_on_ranks(_losses, 2, tmp_path, tp=3)


def test_jit_and_pipeline_are_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--jit does not compile a pipeline step"):
        _losses(tmp_path, pp=2, jit=True)


def test_zero_below_3_without_fsdp_ranks_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--zero must be 1, 2 or 3, got 4"):
        _losses(tmp_path, zero=4)
    with pytest.raises(ValueError, match=r"--zero 2 shards over --fsdp ranks, and this is one"):
        _losses(tmp_path, zero=2)
    # With no dp axis, --dtype and --grad-accum give shard_params an fsdp axis of one rank
    for extra in ({"dp": 2}, {"tp": 2}, {"tp": 2, "dtype": "bfloat16"}, {"tp": 2, "grad_accum": 2}):
        with pytest.raises(RankFailedError, match=r"--zero 1 shards over --fsdp, which is 1 here"):
            run_on_ranks(_losses, 2, tmp_path, zero=1, **extra)


def test_ep_without_moe_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="--ep 2 shards routed experts, and --model llama has none"
    ):
        _losses(tmp_path, ep=2)


class _Crash(Exception):
    pass


def _stop_and_resume(out: Path) -> tuple[list[float], list[float]]:
    """On each pipeline rank: a run that stops after call 5 with a checkpoint at step 3, its
    resumption, and an uninterrupted run; metrics of the last two."""
    layout = {"pp": 2, "steps": 6, "save_every": 3}
    make_step = _train.make_train_step

    def crashing(*args: Any, **kwargs: Any) -> Any:
        step, calls = make_step(*args, **kwargs), []

        def stop_at_5(*step_args: Any) -> Any:
            calls.append(1)
            if len(calls) == 5:
                raise _Crash
            return step(*step_args)

        return stop_at_5

    _train.make_train_step = crashing
    try:
        with pytest.raises(_Crash):
            _losses(out / "stopped", **layout)
    finally:
        _train.make_train_step = make_step
    resumed = _losses(out / "stopped", resume=True, **layout)
    return resumed, _losses(out / "straight", **layout)


def test_pipeline_run_resumes_with_the_losses_of_an_uninterrupted_run(tmp_path: Path) -> None:
    """Each pipeline rank restores its stage from the checkpoint of both stages. Spawned
    ranks: tensorstore, which writes the checkpoint, does not survive a fork."""
    for resumed, straight in run_on_ranks(_stop_and_resume, 2, tmp_path, method="spawn"):
        assert resumed == straight[3:]
    assert (tmp_path / "stopped" / "checkpoints" / "step_6").is_dir()
