"""``d9d train --grad-accum N`` equals the run without it (the same global batch, one update
per step), and ``--dtype bfloat16`` computes in bf16 over float32 master weights."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

import d9d
from d9d.cli import main
from d9d.cli._config import TrainConfig
from d9d.cli._precision import stored_params
from d9d.cli._train_step import _optimizer, _parallel, make_train_step
from d9d.cli.train._run import _check_microbatches
from d9d.errors import ConfigError
from d9d.models import Llama, LlamaConfig
from d9d.testing import run_on_ranks


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


def _one_process_collectives(flags: dict) -> int:
    config = TrainConfig(batch_size=4, seq_len=32, **flags)
    torch.manual_seed(0)
    model = d9d.functionalize(Llama(LlamaConfig.tiny()))
    opt = _optimizer(config)
    step = _parallel(config, make_train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    tokens = torch.randint(0, 256, (4, 33))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    return step.comms(params, state, batch).total_count()


@pytest.mark.parametrize(
    "flags", [{"dtype": "bfloat16"}, {"grad_accum": 2}, {"offload_opt_state": True}]
)
def test_one_process_runs_these_flags_with_no_collective(flags: dict) -> None:
    """In one process each puts shard_params over a one-rank replicate axis: nothing to
    gather or reduce (a one-rank fsdp axis copied every param through a collective)."""
    assert run_on_ranks(_one_process_collectives, 1, flags) == [0]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--grad-accum", "0"], r"--grad-accum must be >= 1, got 0"),
        (["--grad-accum", "2", "--pp", "2"], r"--grad-accum does not combine with --pp"),
        (
            ["--grad-accum", "3", "--batch-size", "8"],
            r"--batch-size 8 gives each of the 1 data-parallel rank\(s\) 8 sequences, which "
            r"do not split into --grad-accum 3 microbatches; pass a --batch-size that is a "
            r"multiple of 3",
        ),
        (["--dtype", "float16"], r"invalid choice: 'float16'"),
        (["--opt-state-dtype", "int8"], r"--opt-state-dtype: invalid choice: 'int8'"),
        (
            ["--master-weights"],
            r"--master-weights stores the params in bfloat16 .* --dtype bfloat16",
        ),
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


def test_opt_state_dtype_stores_bfloat16_moments(tmp_path: Path) -> None:
    """``--opt-state-dtype bfloat16``: the checkpoint's moments are bf16, params float32
    (tests/optim/test_low_precision.py compares the updates with float32 AdamW's)."""
    losses = _run(tmp_path / "low", "--opt-state-dtype", "bfloat16", "--save-every", "3")
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    leaves = json.loads((tmp_path / "low/checkpoints/step_3/metadata.json").read_text())["leaves"]
    moments = {leaf["dtype"] for path, leaf in leaves.items() if re.search(r"\.(mu|nu)\.", path)}
    params = {leaf["dtype"] for path, leaf in leaves.items() if path.startswith("params.")}
    assert moments == {"bfloat16"} and params == {"float32"}


def test_master_weights_store_bfloat16_params_over_float32_masters(tmp_path: Path) -> None:
    """``--master-weights``: the checkpoint's params are bf16 and its optimizer state holds
    their float32 masters; the losses follow ``--dtype bfloat16``'s (float32 params: bf16
    compute over float32 master weights there too) to 1e-4."""
    bf16 = _run(tmp_path / "bf16", "--dtype", "bfloat16")
    losses = _run(tmp_path / "mw", "--dtype", "bfloat16", "--master-weights", "--save-every", "3")
    assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(bf16, losses, strict=True))
    leaves = json.loads((tmp_path / "mw/checkpoints/step_3/metadata.json").read_text())["leaves"]
    params = {leaf["dtype"] for path, leaf in leaves.items() if path.startswith("params.")}
    masters = {
        p.split(".master.")[1]: leaf["dtype"] for p, leaf in leaves.items() if ".master." in p
    }
    assert params == {"bfloat16"}
    assert set(masters.values()) == {"float32"} and len(masters) == len(
        [p for p in leaves if p.startswith("params.")]
    )


def test_master_weights_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """The masters are optimizer state: checkpointed and restored with it."""
    flags = ("--dtype", "bfloat16", "--master-weights", "--save-every", "2")
    run = tmp_path / "run"
    argv = ["train", "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--out", str(run)]

    def losses() -> list[tuple[int, float, float]]:
        records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], r["loss"], r["grad_norm"]) for r in records]

    assert main([*argv, "--no-tensorboard", *flags]) == 0
    whole = losses()
    shutil.rmtree(run / "checkpoints" / "step_4")
    assert main([*argv, "--no-tensorboard", *flags, "--resume"]) == 0
    assert losses() == whole and len(whole) == 4


def test_plan_shows_the_bytes_of_each_zero_stage() -> None:
    """``d9d plan --zero N`` over fsdp=2, tiny Llama (Ψ params, float32, AdamW): params,
    grads and optimizer state per rank, sharded as each stage shards them (ZeRO-1 keeps
    the slices of its all-reduced grads, as ZeRO-2 keeps its reduce-scattered ones)."""
    from d9d.cli.plan._report import human
    from d9d.cli.plan._show import show_plan
    from d9d.models import LlamaConfig

    n = LlamaConfig.tiny().num_params
    whole, half = human(4 * n).split(), human(4 * n // 2).split()
    expected = {3: (half, half), 2: (whole, half), 1: (whole, half)}
    for zero, (params, grads) in expected.items():
        lines = show_plan("tiny", fsdp=2, seq=64, max_rows=2, zero=zero).splitlines()
        head = next(line for line in lines if line.startswith("memory on rank 0"))
        assert head.endswith("):" if zero == 3 else f", ZeRO-{zero} over fsdp):")
        value = {line.split()[0]: line.split()[-2:] for line in lines if line.startswith("  ")}
        assert (value["params"], value["grads"]) == (params, grads)
        assert value["optimizer"] == human(8 * n // 2 + 20).split()
    with pytest.raises(ValueError, match=r"--zero 2 shards over --fsdp, which is 1 here"):
        show_plan("tiny", tp=2, zero=2)


def test_plan_shows_the_optimizer_state_of_bfloat16_moments() -> None:
    """``d9d plan --opt-state-dtype bfloat16``: the optimizer line is 4 bytes a param over
    fsdp=2 (plus adam's and the schedule's counters: 8 + 8 + 4 bytes), not 8."""
    from d9d.cli.plan._report import human
    from d9d.cli.plan._show import show_plan
    from d9d.models import LlamaConfig

    def memory_lines(opt_state_dtype: str) -> tuple[str, str]:
        report = show_plan("tiny", fsdp=2, seq=64, max_rows=2, opt_state_dtype=opt_state_dtype)
        lines = report.splitlines()
        head = next(line for line in lines if line.startswith("memory on rank 0"))
        return head, next(line for line in lines if line.startswith("  optimizer")).split()[-2:]

    n = LlamaConfig.tiny().num_params
    assert memory_lines("float32") == (
        "memory on rank 0 (AdamW, float32):",
        human(8 * n // 2 + 20).split(),
    )
    assert memory_lines("bfloat16") == (
        "memory on rank 0 (AdamW, float32, bfloat16 moments):",
        human(4 * n // 2 + 20).split(),
    )


def test_plan_shows_the_mixed_precision_adam_of_master_weights() -> None:
    """``d9d plan --master-weights --zero N`` over fsdp=2: bfloat16 params and grads (2 bytes
    a param, the grads kept 1/fsdp but under ZeRO-3 and ZeRO-2 and ZeRO-1 alike) and 12
    bytes a param of float32 masters and moments, sharded (plus the counters)."""
    from d9d.cli.plan._report import human
    from d9d.cli.plan._show import show_plan
    from d9d.models import LlamaConfig

    n = LlamaConfig.tiny().num_params
    whole, half = human(2 * n).split(), human(n).split()
    for zero, (params, grads) in {1: (whole, half), 2: (whole, half), 3: (half, half)}.items():
        report = show_plan("tiny", fsdp=2, seq=64, max_rows=2, zero=zero, master_weights=True)
        lines = report.splitlines()
        head = next(line for line in lines if line.startswith("memory on rank 0"))
        assert head.startswith("memory on rank 0 (AdamW, bfloat16 params, float32 masters")
        value = {line.split()[0]: line.split()[-2:] for line in lines if line.startswith("  ")}
        assert (value["params"], value["grads"]) == (params, grads)
        assert value["optimizer"] == human(12 * n // 2 + 20).split()


def test_pipeline_microbatches_that_do_not_split_a_rank_s_rows_name_the_flags() -> None:
    with pytest.raises(ConfigError, match=r"do not split into --microbatches 4 \(2 x --pp by"):
        _check_microbatches(TrainConfig(pp=2, fsdp=2, batch_size=12), data_ranks=2)
    with pytest.raises(
        ConfigError, match=r"6 sequences, which do not split into --microbatches 4 "
    ):
        _check_microbatches(TrainConfig(pp=2, microbatches=4, batch_size=12), data_ranks=2)
    _check_microbatches(TrainConfig(pp=2, fsdp=2, batch_size=16), data_ranks=2)


def _grads_under(flags: dict, model: d9d.Model, batch: dict) -> dict[str, torch.Tensor]:
    """The grads ``d9d train``'s sharding for ``flags`` hands the optimizer, gathered whole."""
    config = TrainConfig(batch_size=4, seq_len=16, **flags)
    model = copy.deepcopy(model)

    def loss_fn(params: dict, batch: dict) -> torch.Tensor:
        return d9d.losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])

    def grads_step(params: dict, opt_state: tuple, batch: dict) -> tuple:
        return d9d.value_and_grad(loss_fn)(params, batch)[1], opt_state, {}

    step = _parallel(config, grads_step)
    params, _ = step.place(stored_params(config, model.params), (), model=model)
    grads, _, _ = step(params, (), step.shard_batch(batch))
    return {k: g.full_tensor() for k, g in grads.items()}


def test_master_weights_sum_the_bfloat16_grads_in_float32() -> None:
    """``--master-weights`` over ``--fsdp 2 --grad-accum 2``: each of the 4 slices' grads is
    computed in bf16 (the bf16 params' own dtype), and they are summed over microbatches and
    ranks in float32, then rounded once to the bf16 grads kept: bit for bit the reference
    below. Summed in bf16 (the params' dtype, what the flag gave before) 10 of the 16,384
    embedding elements differ from it (the greatest by 1.1%)."""
    torch.manual_seed(0)
    model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=1)))
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    flags = {"dtype": "bfloat16", "master_weights": True, "grad_accum": 2, "fsdp": 2}
    got = run_on_ranks(_grads_under, 2, flags, model, batch)[0]
    wanted = {k: torch.zeros(v.shape) for k, v in model.params.items()}
    for row in range(4):
        params = {k: v.detach().bfloat16().requires_grad_() for k, v in model.params.items()}
        logits = model.apply(params, batch["tokens"][row : row + 1])
        loss = d9d.losses.cross_entropy(logits, batch["labels"][row : row + 1])
        grads = torch.autograd.grad(loss, list(params.values()))
        for key, grad in zip(params, grads, strict=True):
            wanted[key] += grad.float()
    for key, grad in got.items():
        assert grad.dtype == torch.bfloat16, key
        torch.testing.assert_close(grad, (wanted[key] / 4).bfloat16(), rtol=0, atol=0)
