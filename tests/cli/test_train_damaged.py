"""``d9d train --resume`` past damaged checkpoints of every kind: each is named with why, moved
aside as ``step_<N>.abandoned`` (never deleted), the run resumes from the newest good one and
saves those steps afresh (issue 23, item 3)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from d9d import checkpoint
from d9d.cli import main
from d9d.cli.train import _run as _train

_LEAF = "arrays/params.embed.weight"


def _args(out: Path, *extra: str) -> list[str]:
    return ["train", "--steps", "12", "--batch-size", "2", "--seq-len", "16", "--out", str(out),
            *extra]  # fmt: skip


def _records(out: Path) -> list[tuple[int, float, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines)]


def _rewrite(file: str, change: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        (path / file).write_bytes(change((path / file).read_bytes()))

    return damage


def _flip(data: bytes) -> bytes:
    return data[:5] + bytes([data[5] ^ 0xFF]) + data[6:]


def _other_shape(data: bytes) -> bytes:
    return json.dumps({**json.loads(data), "shape": [1, 1]}).encode()


# Each damage the damaged-checkpoint tests of d9d.checkpoint know, and what the warning says;
# the first three on steps the resumed run saves again.
_STEPS = (9, 6, 3, 11, 10, 8, 7, 5, 4, 2)
_DAMAGES: list[tuple[str, Callable[[Path], None], str]] = [
    ("no metadata", lambda p: (p / "metadata.json").unlink(), r"it has no metadata\.json"),
    ("no COMMIT", lambda p: (p / "COMMIT").unlink(), r"it has no COMMIT"),
    ("torn metadata", _rewrite("metadata.json", lambda d: d[:50]), r"is not valid JSON"),
    (
        "metadata fields",
        _rewrite("metadata.json", lambda d: b'{"format": "d9d.checkpoint/1"}'),
        r"is not a d9d checkpoint's metadata: missing",
    ),
    ("flipped byte", _rewrite(f"{_LEAF}/c/0/0", _flip), r"Digest mismatch"),
    ("torn chunk", _rewrite(f"{_LEAF}/c/0/0", lambda d: d[:10]), r"params\.embed\.weight"),
    ("extra bytes", _rewrite(f"{_LEAF}/c/0/0", lambda d: d + b"\0"), r"truncated or overwritten"),
    ("no chunk", lambda p: (p / _LEAF / "c/0/0").unlink(), r"params\.embed\.weight.* missing"),
    ("no zarr.json", lambda p: (p / _LEAF / "zarr.json").unlink(), r"params\.embed\.weight"),
    ("zarr.json", _rewrite(f"{_LEAF}/zarr.json", _other_shape), r"has shape=\[1, 1\]"),
]


class _Crash(Exception):
    pass


def test_every_damaged_checkpoint_is_moved_aside_and_its_step_saved_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    make_step = _train.make_train_step

    def crash_in_step_12(*args: Any, **kwargs: Any) -> Any:
        step, calls = make_step(*args, **kwargs), []

        def wrapped(*step_args: Any) -> Any:
            calls.append(1)
            if len(calls) == 12:
                raise _Crash
            return step(*step_args)

        return wrapped

    with monkeypatch.context() as patch:
        patch.setattr(_train, "make_train_step", crash_in_step_12)
        with pytest.raises(_Crash):
            main(_args(out, "--save-every", "1"))
    uninterrupted = _records(out)  # steps 1-11, as an uninterrupted run logs them
    assert len(checkpoint.all_checkpoints(checkpoints)) == 11
    damaged = {}
    for step, (_, damage, _) in zip(_STEPS, _DAMAGES, strict=True):
        damage(checkpoints / f"step_{step}")
        damaged[step] = _files(checkpoints / f"step_{step}")
    (checkpoints / "step_12.tmp-0dead000" / "arrays").mkdir(parents=True)  # the crashed save's
    capsys.readouterr()

    assert main(_args(out, "--save-every", "3", "--resume")) == 0
    err = capsys.readouterr().err.splitlines()
    for step, (name, _, why) in zip(_STEPS, _DAMAGES, strict=True):
        folder = checkpoints / f"step_{step}"
        (line,) = [line for line in err if f"'{folder}' " in line]
        assert re.fullmatch(
            rf"d9d train: warning: '{folder}' cannot be restored \(.*{why}.*\); moved it aside "
            rf"to 'step_{step}.abandoned'",
            line,
        ), (name, line)
        assert _files(checkpoints / f"step_{step}.abandoned") == damaged[step]  # as it was
    assert f"resumed from '{checkpoints / 'step_1'}' at step 2" in err[-1]
    assert _records(out)[:11] == uninterrupted
    saved = sorted(p.name for p in checkpoints.iterdir() if "abandoned" not in p.name)
    assert saved == ["step_1", "step_12", "step_3", "step_6", "step_9"]  # the dead save swept
    assert checkpoint.latest(checkpoints) == checkpoints / "step_12"


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
