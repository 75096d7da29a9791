"""``d9d train``'s start-up header and the closing line naming every file it wrote, as the
command prints them."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest
import torch

import d9d.cli.train._report
from d9d import functionalize
from d9d.cli import main
from d9d.cli._config import TrainConfig
from d9d.cli.train._report import header_lines
from d9d.models import Llama, LlamaConfig


def _args(out: Path, *extra: str) -> list[str]:
    return ["train", "--batch-size", "2", "--seq-len", "16", "--out", str(out), *extra]


def test_header_names_model_data_step_device_and_out_before_the_first_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("d9d " * 1250)  # 5,000 bytes: 5,000 byte tokens
    assert main(_args(tmp_path / "run", "--steps", "2", "--data", str(text))) == 0
    lines = capsys.readouterr().out.splitlines()
    params = LlamaConfig.tiny().num_params  # the formula, not a count of the run's tensors
    assert lines[:5] == [
        f"model  Llama preset 'tiny' (2 layers, dim 64, vocab 256): "
        f"{params / 1e3:.2f}K ({params:,}) params",
        f"data   {text} (text, as bytes): 5,000 tokens; 2 steps read 64 of them (0.0128 epochs)",
        "batch  2 sequences x 16 tokens = 32 tokens per step",
        f"device cpu ({torch.get_num_threads()} thread{'s' * (torch.get_num_threads() > 1)}), "
        "1 process",
        f"out    {tmp_path / 'run'}",
    ]
    assert lines[5].startswith("step 1/2 loss ")
    assert sum(line.startswith("model ") for line in lines) == 1


def test_header_counts_epochs_in_the_loader_s_windows() -> None:
    # 300 tokens are 18 windows of 16 + 1; 8 steps of 4 sequences read 32 windows, 1.78
    # epochs. The header said 512 / 300 = 1.71, as if every token began a sequence.
    config = TrainConfig(steps=8, batch_size=4, seq_len=16, data=Path("small.txt"))
    model = functionalize(Llama(LlamaConfig.tiny()))
    rows = header_lines(config, LlamaConfig.tiny(), model, None, 300, 0, torch.device("cpu"))
    assert rows[1] == (
        "data",
        "small.txt (text, as bytes): 300 tokens; 8 steps read 512 of them (1.78 epochs)",
    )


def _named(line: str, out: Path) -> set[str]:
    """The names the closing line lists under ``out``, braces expanded as a shell would."""
    listed = line.split(f"wrote {out}/: ", 1)[1].split(", ")
    names = set()
    for name in listed:
        braces = re.fullmatch(r"(.*)\{([\d,]+)\}(.*)", name)
        parts = braces[2].split(",") if braces else [""]
        names |= {f"{braces[1]}{p}{braces[3]}" if braces else name for p in parts}
    return names


def _on_disk(out: Path) -> set[str]:
    """What ``out`` holds: its files and folders, checkpoints and traces one by one."""
    found = set()
    for entry in out.iterdir():
        if entry.name in ("checkpoints", "profile"):
            found |= {
                f"{entry.name}/{child.name}" + ("/" if child.is_dir() else "")
                for child in entry.iterdir()
            }
        else:
            found.add(entry.name + ("/" if entry.is_dir() else ""))
    return found


def test_last_line_names_every_file_the_run_wrote_and_only_those(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    first = ("--steps", "4", "--save-every", "2", "--profile", "--profile-steps", "1")
    assert main(_args(out, *first)) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("loss ")
    assert _named(last, out) == _on_disk(out) == {
        "config.json", "metrics.jsonl", "loss.png", "tensorboard/",
        "checkpoints/step_2/", "checkpoints/step_4/", "profile/rank0.json",
    }  # fmt: skip
    # A resumed call names its own checkpoint, not the earlier ones nor the earlier trace.
    assert (
        main(_args(out, "--steps", "6", "--save-every", "2", "--resume", "--allow-config-change"))
        == 0
    )
    last = capsys.readouterr().out.splitlines()[-1]
    assert _named(last, out) == {
        "config.json", "metrics.jsonl", "loss.png", "tensorboard/", "checkpoints/step_6/",
    }  # fmt: skip


def test_the_header_example_runs() -> None:
    assert doctest.testmod(d9d.cli.train._report).failed == 0
