"""``d9d train`` recovers: no non-finite checkpoint, damaged ones skipped, resumes say what they
did and refuse changed flags, metrics survive a crash, failures are one line (issue 12)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from d9d import checkpoint
from d9d.checkpoint import _format
from d9d.cli import main
from d9d.cli.train import _run as _train
from d9d.cli.train._data import training_tokens


def _args(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--steps",
        "4",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--out",
        str(out),
        *extra,
    ]


def _records(out: Path) -> list[tuple[int, float, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["lr"]) for r in map(json.loads, lines)]


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().err


class _Crash(Exception):
    pass


def _patch_step(patch: pytest.MonkeyPatch, before_call: Any) -> None:
    """Run ``before_call(n)`` before the n-th call of the train step (n from 1)."""
    make_step = _train.make_train_step

    def patched(*args: Any, **kwargs: Any) -> Any:
        step, calls = make_step(*args, **kwargs), []

        def wrapped(*step_args: Any) -> Any:
            calls.append(1)
            before_call(len(calls))
            return step(*step_args)

        return wrapped

    patch.setattr(_train, "make_train_step", patched)


def _crash_at(n: int) -> Any:
    def before_call(call: int) -> None:
        if call == n:
            raise _Crash

    return before_call


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float, float]]:
    """The records of an uninterrupted 4-step run."""
    out = tmp_path_factory.mktemp("reference")
    assert main(_args(out)) == 0
    return _records(out)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run saving every step that crashed in step 4: step_1..step_3 committed."""
    out = tmp_path_factory.mktemp("crashed") / "run"
    with pytest.MonkeyPatch.context() as patch:
        _patch_step(patch, _crash_at(4))
        with pytest.raises(_Crash):
            main(_args(out, "--save-every", "1"))
    assert [p.name for p in checkpoint.all_checkpoints(out / "checkpoints")] == [
        "step_1",
        "step_2",
        "step_3",
    ]
    return out


@pytest.fixture
def run(crashed: Path, tmp_path: Path) -> Path:
    shutil.copytree(crashed, tmp_path / "run")
    return tmp_path / "run"


# Item 9: a non-finite loss is never checkpointed.


def test_non_finite_loss_keeps_the_last_finite_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(_args(out, "--steps", "6", "--lr", "1e6", "--save-every", "1", "--keep", "2")) == 1
    err = _err(capsys).strip().splitlines()
    assert len(err) == 1
    found = re.search(
        r"d9d train: error: loss is \S+ and gradient norm \S+ at step (\d+); step (\d+)'s "
        r"checkpoint, whose params gave them, is dropped and the older ones in '.*' stay",
        err[0],
    )
    assert found, err
    bad = int(found.group(1))
    assert int(found.group(2)) == bad - 1
    saved = checkpoint.all_checkpoints(out / "checkpoints")
    assert [p.name for p in saved] == [f"step_{s}" for s in range(max(1, bad - 3), bad - 1)]
    for path in saved:
        leaves = checkpoint.restore(path).values()
        assert all(torch.isfinite(v).all() for v in leaves if isinstance(v, torch.Tensor))
    # --resume recovers with a lower learning rate.
    again = _args(out, "--steps", "6", "--lr", "1e-3", "--save-every", "1", "--resume")
    assert main([*again, "--allow-config-change"]) == 0
    assert f"resumed from '{saved[-1]}' at step {bad - 1}" in _err(capsys)
    assert [s for s, _, _ in _records(out)] == list(range(1, 7))


def test_non_finite_grad_norm_alone_stops_before_saving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    make_step = _train.make_train_step

    def inf_norm_at_3(*args: Any, **kwargs: Any) -> Any:
        step, calls = make_step(*args, **kwargs), []

        def wrapped(*step_args: Any) -> Any:
            calls.append(1)
            params, opt_state, metrics = step(*step_args)
            if len(calls) == 3:
                metrics = {**metrics, "grad_norm": torch.tensor(float("inf"))}
            return params, opt_state, metrics

        return wrapped

    monkeypatch.setattr(_train, "make_train_step", inf_norm_at_3)
    assert main(_args(tmp_path, "--save-every", "1", "--log-every", "4")) == 1
    assert "gradient norm inf at step 3; step 2's checkpoint, whose params gave them" in _err(
        capsys
    )
    assert [p.name for p in checkpoint.all_checkpoints(tmp_path / "checkpoints")] == ["step_1"]
    assert not (tmp_path / "metrics.jsonl").read_text()  # nothing logged: --log-every 4


# Item 10: metrics.jsonl survives a crash, without duplicates.


def test_each_record_reaches_the_file_before_the_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []

    def count_records(call: int) -> None:
        path = tmp_path / "metrics.jsonl"
        seen.append(len(path.read_text().splitlines()) if path.exists() else 0)

    _patch_step(monkeypatch, count_records)
    assert main(_args(tmp_path)) == 0
    assert seen == [0, 1, 2, 3]


def test_resume_drops_later_records_and_a_torn_line(
    run: Path, reference: list, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoints = run / "checkpoints"
    shutil.rmtree(checkpoints / "step_3")  # as if the kill had come before its commit
    assert [s for s, _, _ in _records(run)] == [1, 2, 3]
    with (run / "metrics.jsonl").open("a") as log:
        log.write('{"step": 4, "lo')  # torn by the kill
    assert main(_args(run, "--save-every", "1", "--resume")) == 0
    assert _records(run) == reference
    out, err = capsys.readouterr()
    assert f"resumed from '{checkpoints / 'step_2'}' at step 3" in err
    assert "in 2 steps (3-4)" in out  # the steps this process ran


# Item 11: --resume says what it did and refuses changed flags.


def test_resume_without_checkpoint_says_so_and_config_records_the_warmup_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_args(tmp_path, "--resume", "--warmup", "20")) == 0
    assert f"no checkpoint in '{tmp_path / 'checkpoints'}'; starting at step 1" in _err(capsys)
    assert json.loads((tmp_path / "config.json").read_text())["warmup"] == 3  # steps - 1


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--lr", "0.01", r"--lr 0.01 \(was 0.003\)"),
        ("--steps", "6", r"--steps 6 \(was 4\)"),
        ("--warmup", "1", r"--warmup 1 \(was 3\)"),
        ("--preset", "small", r"--preset small \(was tiny\)"),
        ("--seed", "5", r"--seed 5 \(was 0\)"),
    ],
)
def test_resume_refuses_a_changed_schedule_or_model_flag(
    run: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    assert main([*_args(run, "--resume"), flag, value]) == 2
    err = _err(capsys).strip().splitlines()
    assert len(err) == 1
    assert re.search(
        message + r".* differs? from '.*config.json' of the run that wrote the checkpoint.*"
        r"--allow-config-change",
        err[0],
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--opt-state-dtype", "bfloat16"], r"--opt-state-dtype bfloat16 \(was float32\)"),
        (["--offload-opt-state"], r"--offload-opt-state True \(was False\)"),
    ],
)
def test_resume_refuses_a_changed_optimizer_state_layout_by_name(
    run: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main([*_args(run, "--resume", "--allow-config-change"), *flags]) == 2
    err = _err(capsys).strip().splitlines()
    assert len(err) == 1
    assert re.search(message + r": the checkpoint's optimizer state is laid out", err[0])


def test_allow_config_change_resumes_with_the_new_flags(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*_args(run, "--resume", "--steps", "5", "--allow-config-change")]) == 0
    assert "warning: resuming with changed flags: --steps 5 (was 4)" in _err(capsys)
    assert [s for s, _, _ in _records(run)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("flag", "value"), [("--batch-size", "4"), ("--seq-len", "8"), ("--seed", "5")]
)
def test_allow_config_change_refuses_a_changed_data_order_before_restoring(
    run: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    # It warned "resuming with changed flags", restored, said "resumed from ... at step 4",
    # then the loader refused the position with advice for library code, exit 2.
    assert main([*_args(run, "--resume", "--allow-config-change"), flag, value]) == 2
    err = _err(capsys).strip().splitlines()
    assert len(err) == 1, err
    old = {"--batch-size": "2", "--seq-len": "16", "--seed": "0"}[flag]
    assert err[0].startswith(f"d9d train: error: {flag} {value} (was {old}): the checkpoint's ")
    assert "data position counts steps of 2 sequences of 16 tokens in --seed 0's order" in err[0]
    assert err[0].endswith("pass the old values to resume, or start a new run in another --out")


# Item 12: a damaged newest checkpoint is recoverable from the CLI.


# Every kind of damaged checkpoint: tests/cli/test_train_damaged.py.


def test_resume_from_a_path(run: Path, reference: list, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoints = run / "checkpoints"
    assert main(_args(run, "--resume-from", str(checkpoints / "step_1"))) == 0
    assert f"resumed from '{checkpoints / 'step_1'}' at step 2" in _err(capsys)
    assert _records(run) == reference
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "step_1",
        "step_2.abandoned",
        "step_3.abandoned",
    ]


@pytest.mark.parametrize("given", ["run", "checkpoints"])
def test_resume_from_a_run_folder_names_its_newest_checkpoint(
    run: Path, capsys: pytest.CaptureFixture[str], given: str
) -> None:
    folder = run if given == "run" else run / "checkpoints"
    assert main(_args(run, "--resume-from", str(folder))) == 2
    err = _err(capsys).strip().splitlines()
    newest = run / "checkpoints" / "step_3"
    assert len(err) == 1
    assert "is a run's folder, not a checkpoint; pass one of its checkpoints, the newest " in err[0]
    assert f"--resume-from '{newest}', or --resume with --out '{run}'" in err[0]


def test_resume_from_a_damaged_path_is_one_line_naming_the_file(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = run / "checkpoints" / "step_2"
    (path / "metadata.json").write_text("{")
    assert main(_args(run, "--resume-from", str(path))) == 2
    err = _err(capsys).strip().splitlines()
    assert len(err) == 1 and f"'{path / 'metadata.json'}' is not valid JSON" in err[0]


# Item 14: other world sizes, one-line failures, binary data.


def test_resume_across_world_sizes_resets_the_rng_with_a_warning(
    run: Path, reference: list, capsys: pytest.CaptureFixture[str]
) -> None:
    path = run / "checkpoints" / "step_3"
    meta = json.loads((path / "metadata.json").read_text())
    meta["world_size"], meta["metadata"]["rng"] = 2, meta["metadata"]["rng"] * 2  # saved by 2 ranks
    (path / "metadata.json").write_text(json.dumps(meta))
    assert main(_args(run, "--resume")) == 0
    assert f"'{path}' was saved by 2 ranks and this run has 1" in _err(capsys)
    assert _records(run) == reference  # d9d train draws no random numbers after init


def test_checkpoint_save_error_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def full_disk(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_format, "commit", full_disk)
    assert main(_args(tmp_path, "--save-every", "2")) == 1
    err = _err(capsys).strip().splitlines()
    assert len(err) == 1
    assert re.search(
        r"error: Saving step 2 to .* failed on rank 0: OSError: .*No space left", err[0]
    )


def test_permission_error_is_one_line_and_debug_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def denied(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied", str(tmp_path / "loss.png"))

    monkeypatch.setattr(_train, "_plot", denied)
    assert main(_args(tmp_path, "--steps", "1")) == 1
    err = _err(capsys).strip().splitlines()
    assert len(err) == 1 and "Permission denied" in err[0] and "--debug" in err[0]
    with pytest.raises(PermissionError, match="Permission denied"):
        main(_args(tmp_path / "again", "--steps", "1", "--debug"))


def test_data_folder_with_train_bin_is_read_as_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    np.random.default_rng(0).integers(0, 256, 4096).astype(np.uint16).tofile(folder / "train.bin")
    assert main(_args(tmp_path / "file", "--steps", "2", "--data", str(folder / "train.bin"))) == 0
    assert main(_args(tmp_path / "folder", "--steps", "2", "--data", str(folder))) == 0
    assert f"reading uint16 token ids from '{folder / 'train.bin'}'" in _err(capsys)
    assert _records(tmp_path / "folder") == _records(tmp_path / "file")


def test_binary_data_is_refused_not_read_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    np.arange(300, dtype=np.uint16).tofile(folder / "val.bin")
    assert main(_args(tmp_path / "run", "--data", str(folder))) == 2
    assert re.search(r"holds token files \['val.bin'\] but no train.bin", _err(capsys))
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "tokens.u16")
    assert main(_args(tmp_path / "run", "--data", str(tmp_path / "tokens.u16"))) == 2
    assert re.search(r"tokens.u16' is not text \(it holds NUL bytes\)", _err(capsys))


def test_a_vocab_past_what_uint16_token_ids_hold_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # uint32 ids of a 70,000-id vocab, read as uint16, are pairs of wrong ids below 65,536:
    # nothing else refuses them, and the run trained on those.
    np.random.default_rng(0).integers(0, 70_000, 4096).astype(np.uint32).tofile(tmp_path / "t.bin")
    args = _args(tmp_path / "run", "--data", str(tmp_path / "t.bin"), "--vocab-size", "70000")
    assert main(args) == 2
    err = _err(capsys).strip().splitlines()
    assert len(err) == 2 and err[0].startswith("d9d train: --data: reading uint16 token ids")
    assert "vocab_size is 70000, but --data is read as uint16 token ids" in err[1]
    assert "pass --token-dtype uint32 if it holds uint32 ids" in err[1]


def test_uint32_token_ids_train_as_the_same_ids_in_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A vocab above 65,536 (Llama 3's 128,256) needs uint32 ids: d9d train read only uint16.
    ids = np.random.default_rng(0).integers(0, 70_000, 4096)
    ids.astype(np.uint32).tofile(tmp_path / "t.bin")
    vocab = ("--vocab-size", "70000", "--steps", "2")
    run = _args(tmp_path / "run", "--data", str(tmp_path / "t.bin"), "--token-dtype", "uint32")
    assert main([*run, *vocab]) == 0
    assert "reading uint32 token ids from" in _err(capsys)
    assert training_tokens(tmp_path / "t.bin", "uint32").tolist() == ids.tolist()
    # The same file read as uint16 names the flag; uint16 ids read as uint32 are refused.
    assert main(_args(tmp_path / "a", "--data", str(tmp_path / "t.bin"), *vocab)) == 2
    assert "--token-dtype uint32" in _err(capsys)
    ids.astype(np.uint16).tofile(tmp_path / "u16.bin")
    wide = _args(tmp_path / "b", "--data", str(tmp_path / "u16.bin"), "--token-dtype", "uint32")
    assert main([*wide, *vocab]) == 2
    assert "or --token-dtype uint16, if the file holds uint16 ids" in _err(capsys)
    # Text data has no token dtype: the flag is refused, not ignored.
    assert main(_args(tmp_path / "c", "--token-dtype", "uint32")) == 2
    assert "--token-dtype uint32 applies to a .bin token file" in _err(capsys)


def test_binary_files_in_a_text_folder_are_refused_not_read_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A folder's files were read as text whatever they held: the .npy's bytes, NULs dropped,
    # trained on as if they were text.
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("hello d9d " * 200)
    np.save(folder / "sub" / "weights.npy", np.arange(300, dtype=np.float32))
    assert main(_args(tmp_path / "run", "--data", str(folder))) == 2
    err = _err(capsys).strip().splitlines()
    assert len(err) == 1
    assert "holds files that are not text (they hold NUL bytes): ['sub/weights.npy']" in err[0]


def test_an_out_folder_inside_the_data_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The run's config.json and metrics.jsonl were read as text by any later read of --data
    # (a rank that reads late, a rerun, a --resume): the data changed under the run.
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("hello d9d " * 200)
    assert main(_args(folder / "runs" / "a", "--data", str(folder))) == 2
    err = _err(capsys).strip().splitlines()
    assert len(err) == 1
    assert f"--out '{folder / 'runs' / 'a'}' is inside --data '{folder}'" in err[0]
    assert not (folder / "runs").exists()


def test_resume_on_data_changed_to_as_many_tokens_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The same --data path, rewritten with other text of the same length: the loader's
    # position checked only the window count, so the run resumed over other data, exit 0.
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("hello d9d " * 20)
    args = _args(tmp_path / "run", "--steps", "2", "--save-every", "2", "--data", str(folder))
    assert main(args) == 0
    (folder / "a.txt").write_text("HELLO D9D " * 20)
    capsys.readouterr()
    assert main([*args, "--resume"]) == 2
    err = _err(capsys).strip().splitlines()
    assert len(err) == 1, err  # not "resumed from" first
    step_2 = tmp_path / "run" / "checkpoints" / "step_2"
    assert re.fullmatch(
        rf"d9d train: error: '{re.escape(str(step_2))}' was saved reading other tokens than this run reads "
        r"\(tokens_digest \d+ \(this run's: \d+\)\): pass the --data \(with the files it held "
        r"then\), --token-dtype and --eval-fraction of the run that wrote it, or start a new "
        r"run in another --out",
        err[0],
    )
