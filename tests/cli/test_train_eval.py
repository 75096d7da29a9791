"""``d9d train --eval-every``'s evaluator (``d9d/cli/train/_eval.py``): its held-out loss is that
of the model in eval mode, it leaves every module in the mode it found it in, and every layout
logs the eval losses of one process (forked gloo ranks)."""

from __future__ import annotations

import functools
import io
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rich.console import Console
from torch import nn

import d9d
from d9d import data
from d9d.cli._config import TrainConfig
from d9d.cli.train._eval import Evaluator
from d9d.cli.train._run import train
from d9d.testing import run_on_ranks

_VOCAB, _SEQ_LEN, _BATCH, _BATCHES = 32, 8, 2, 2


def _model() -> d9d.Model:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Embedding(_VOCAB, 16), nn.Dropout(0.5), nn.Linear(16, _VOCAB))
    module[2].eval()  # a module the user keeps in eval mode: it must stay there
    return d9d.functionalize(module)


def test_eval_runs_the_model_in_eval_mode_and_puts_each_module_back() -> None:
    model = _model()
    held_out = (np.arange(200) * 7 % _VOCAB).astype(np.uint16)
    evaluate = Evaluator(
        model,
        None,  # no transformed step: the evaluation runs in this process, on its own
        held_out,
        batches=_BATCHES,
        batch_size=_BATCH,
        seq_len=_SEQ_LEN,
        device=torch.device("cpu"),
    )
    modes = [m.training for m in model.module.modules()]
    loss = evaluate(model.params)["eval_loss"]

    assert [m.training for m in model.module.modules()] == modes == [True, True, True, False]
    model.module.eval()  # the reference: dropout off
    loader = data.TokenLoader(held_out, global_batch_size=_BATCH, seq_len=_SEQ_LEN)
    expected = [
        float(d9d.losses.cross_entropy(model.apply(model.params, b["tokens"]), b["labels"]))
        for b in (loader.batch(i) for i in range(_BATCHES))
    ]
    assert loss == sum(expected) / _BATCHES  # the evaluator's own arithmetic: bit for bit


_RUN = {"steps": 2, "batch_size": 4, "seq_len": 32, "eval_every": 1, "eval_batches": 2}


def _eval_losses(out: Path, **layout: Any) -> list[float]:
    config = TrainConfig(out=out, **{**_RUN, **layout})
    return [r["eval_loss"] for r in train(config, console=Console(file=io.StringIO())).records]


@functools.cache
def _one_process(model: str) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        return _eval_losses(Path(tmp), model=model)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [
        {"tp": 2},
        {"cp": 2},
        {"dp": 2, "tp": 2},
        {"fsdp": 2, "grad_accum": 2},  # eval runs the whole batch: no microbatches
        {"model": "moe", "ep": 2},
    ],
    ids=lambda layout: ",".join(f"{k}={v}" for k, v in layout.items()),
)
def test_eval_loss_is_that_of_one_process(
    layout: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Each rank evaluates its data-parallel share of the same held-out batches, and the
    step's token mean makes the ranks' loss that of the whole batch."""
    expected = _one_process(layout.get("model", "llama"))
    world = math.prod(v for k, v in layout.items() if k in ("dp", "fsdp", "ep", "tp", "cp"))
    out = tmp_path_factory.mktemp("ranks")
    for losses in run_on_ranks(_eval_losses, world, out, method="fork", timeout=300, **layout):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
