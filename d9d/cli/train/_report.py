"""What ``d9d train`` says about a run besides its progress: a header before the first step
(model, data, tokens per step, device and world, output folder), printed once by rank 0, and
the closing line's list of the files the run wrote."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.text import Text
from torch.distributed.device_mesh import DeviceMesh

from ... import checkpoint
from ...core._model import Model
from ...core._step import TransformedStep
from ...data import num_windows
from ...models import LlamaConfig, MoEConfig
from ...transforms.diloco import DiLoCoStep
from .._config import TrainConfig

__all__ = ["header_lines", "print_header", "written_files"]


def header_lines(
    config: TrainConfig,
    model_config: LlamaConfig | MoEConfig,
    model: Model,
    step: Any,
    tokens: int,
    held_out: int,
    device: torch.device,
) -> list[tuple[str, str]]:
    """The header as ``(label, text)`` rows: model, data, batch, device, out.

    Args:
        config: The run's options.
        model_config: The model's shapes.
        model: The functionalized model (its params are counted, a tied weight once).
        step: The training step: a :class:`TransformedStep` under ``torchrun`` (its mesh is
            shown), the plain step in one process.
        tokens: Tokens the training loader reads from (held-out ones excluded).
        held_out: Tokens held out for ``--eval-every`` (0: none).
        device: Where this rank computes.

    Returns:
        Five rows, each a label and one line of text.

    Example:
        >>> from d9d import functionalize
        >>> from d9d.models import Llama
        >>> model = functionalize(Llama(LlamaConfig.tiny()))
        >>> rows = header_lines(TrainConfig(), LlamaConfig.tiny(), model, None, 10**6, 0,
        ...     torch.device("cpu"))
        >>> rows[0]
        ('model', "Llama preset 'tiny' (2 layers, dim 64, vocab 256): 125.25K (125,248) params")
        >>> rows[2]
        ('batch', '16 sequences x 128 tokens = 2,048 tokens per step')
    """
    num_params = sum(p.numel() for p in model.params.values())
    mesh = step.mesh if isinstance(step, TransformedStep | DiLoCoStep) else None
    per_step = config.batch_size * config.seq_len
    data = f"{_source(config.data)}: {tokens:,} tokens"
    if held_out:
        data += f" (and {held_out:,} held out for --eval-every)"
    read = config.steps * per_step
    # An epoch is the loader's windows, not the tokens: the tail past the last window is never
    # read, and each window's last token is the next one's first (a 300-token stream is 18
    # windows of 16 + 1: 8 steps of 4 read 1.78 epochs, not 512 / 300 = 1.71).
    epochs = config.steps * config.batch_size / max(num_windows(tokens, config.seq_len), 1)
    data += f"; {config.steps} steps read {read:,} of them ({epochs:.3g} epochs)"
    batch = (
        f"{config.batch_size} sequences x {config.seq_len} tokens = {per_step:,} tokens per step"
    )
    return [
        ("model", f"{_model(config, model_config)}: {_count(num_params)} params"),
        ("data", data),
        ("batch", batch),
        ("device", _device(device, mesh)),
        ("out", str(config.out) + (" (resuming)" if config.resume or config.resume_from else "")),
    ]


def print_header(console: Console, rows: list[tuple[str, str]]) -> None:
    """The rows, one line each, never wrapped (a log file keeps each row on one line)."""
    for label, text in rows:
        console.print(Text.assemble((f"{label:<7}", "bold cyan"), text), soft_wrap=True)


def written_files(config: TrainConfig, first_step: int) -> str:
    """``"wrote OUT/: metrics.jsonl, ..."``: every file and folder this call of ``d9d train``
    wrote under ``config.out`` that is still there, as rank 0 sees them after the run.

    Checkpoints are the ``step_<N>`` folders saved after ``first_step`` (``--keep`` may have
    rotated some away); profiler traces are each rank's ``profile/rank<R>.json`` (on several
    nodes without a shared folder, rank 0 sees its own node's).
    """
    out = config.out
    names = ["config.json", "metrics.jsonl", "loss.png"]
    if config.tensorboard and _installed("tensorboard") and (out / "tensorboard").is_dir():
        names.append("tensorboard/")
    wandb_dir = Path(os.environ.get("WANDB_DIR", out)) / "wandb"
    if config.wandb and wandb_dir.is_dir():
        names.append(_under(out, wandb_dir) + "/")
    steps = [
        int(p.name.removeprefix("step_")) for p in checkpoint.all_checkpoints(out / "checkpoints")
    ]
    saved = [step for step in steps if step > first_step]
    if saved:
        names.append(f"checkpoints/step_{_braces(saved)}/")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    traced = [r for r in range(world) if (out / "profile" / f"rank{r}.json").is_file()]
    if config.profile and traced:
        names.append(f"profile/rank{_braces(traced)}.json")
    return f"wrote {out}/: {', '.join(names)}"


def _model(config: TrainConfig, model_config: LlamaConfig | MoEConfig) -> str:
    shapes = (
        f"{model_config.n_layers} layers, dim {model_config.dim}, vocab {model_config.vocab_size:,}"
    )
    if isinstance(model_config, MoEConfig):
        moe = model_config.moe
        shared = f" + {moe.n_shared_experts} shared" if moe.n_shared_experts else ""
        shapes += f", {moe.n_experts} experts top-{moe.top_k}{shared}"
        return f"MoE preset {config.preset!r} ({shapes})"
    return f"Llama preset {config.preset!r} ({shapes})"


def _source(path: Path | None) -> str:
    if path is None:
        return "the Python standard library's sources, as bytes"
    if path.is_dir() and (path / "train.bin").is_file():
        return f"{path / 'train.bin'} (uint16 token ids)"
    if path.suffix == ".bin":
        return f"{path} (uint16 token ids)"
    return f"{path} (text, as bytes)"


def _device(device: torch.device, mesh: DeviceMesh | None) -> str:
    if device.type == "cuda":
        where = f"{device} ({torch.cuda.get_device_name(device)})"
    else:
        threads = torch.get_num_threads()
        where = f"{device.type} ({threads} thread{'' if threads == 1 else 's'})"
    if mesh is None:
        return f"{where}, 1 process"
    names = mesh.mesh_dim_names or ()
    layout = " x ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True))
    return f"{where} per rank, {mesh.size()} ranks: {layout}"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit} ({n:,})"
    return f"{n:,}"


def _braces(numbers: list[int]) -> str:
    """``7`` or ``{2,4,6}``: what a shell expands back to each name."""
    return str(numbers[0]) if len(numbers) == 1 else "{" + ",".join(map(str, numbers)) + "}"


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _under(out: Path, path: Path) -> str:
    try:
        return path.relative_to(out).as_posix()
    except ValueError:
        return str(path)
