"""The training loop behind ``d9d train``: a Llama preset on a token corpus, one process."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from . import checkpoint, data, losses, optim
from ._autodiff import value_and_grad
from ._jit import jit
from ._module import Model, functionalize
from .errors import DataError
from .models import Llama, LlamaConfig

__all__ = ["TrainConfig", "make_train_step", "train"]

_NO_DECAY = r"(norm\.weight|bias)$"


@dataclass(frozen=True)
class TrainConfig:
    """Options of ``d9d train``; each field is the command-line flag of the same name."""

    preset: str = "tiny"
    steps: int = 200
    lr: float = 3e-3
    batch_size: int = 16  # sequences per step, over all data-parallel ranks
    seq_len: int = 128
    seed: int = 0
    out: Path = Path("runs/train")
    data: Path | None = None  # None: the Python standard library's own source files
    vocab_size: int | None = None  # None: the preset's
    warmup: int = 20
    weight_decay: float = 0.1
    clip: float = 1.0
    jit: bool = False
    log_every: int = 1
    save_every: int = 0  # steps between checkpoints in out/checkpoints; 0: none
    keep: int | None = None  # newest checkpoints kept; None: all
    resume: bool = False  # continue from the latest complete checkpoint, if there is one


def make_train_step(model: Model, opt: optim.GradientTransformation) -> Callable[..., Any]:
    """The step ``d9d train`` runs: next-token cross entropy, grads, one optimizer update.

    Args:
        model: A functionalized language model: ``model.apply(params, tokens) -> logits``.
        opt: The optimizer.

    Returns:
        ``step(params, opt_state, batch) -> (params, opt_state, {"loss": loss})`` where
        ``batch`` holds ``"tokens"`` and ``"labels"`` of shape ``[batch, seq_len]``.

    Example:
        >>> model = functionalize(Llama(LlamaConfig.tiny()))
        >>> opt = optim.sgd(0.1)
        >>> step = make_train_step(model, opt)
        >>> tokens = torch.zeros(1, 8, dtype=torch.long)
        >>> _, _, metrics = step(model.params, opt.init(model.params), {"tokens": tokens, "labels": tokens})
        >>> metrics["loss"].shape
        torch.Size([])
    """

    def loss_fn(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])

    def step(params: Any, opt_state: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, Any, Any]:
        loss, grads = value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, {"loss": loss}

    return step


def _optimizer(config: TrainConfig) -> optim.GradientTransformation:
    schedule = optim.warmup_cosine(
        config.lr,
        min(config.warmup, config.steps - 1),
        max(config.steps, 2),
        end_value=config.lr / 10,
    )
    return optim.chain(
        optim.clip_by_global_norm(config.clip),
        optim.adamw(schedule, b2=0.95, weight_decay=config.weight_decay, mask=_decays),
    )


def _decays(path: str, param: torch.Tensor) -> bool:
    return param.ndim >= 2


def _tokens(config: TrainConfig) -> Any:
    if config.data is None:
        return data.stdlib_corpus()
    if not config.data.exists():
        raise DataError(
            f"--data {str(config.data)!r} does not exist; pass a text file, a folder of text files or a .bin token file"
        )
    return config.data


def _model_config(config: TrainConfig, tokens: Any) -> LlamaConfig:
    model_config = LlamaConfig.preset(config.preset)
    if config.vocab_size is not None:
        model_config = replace(model_config, vocab_size=config.vocab_size)
    largest = int(tokens.max())
    if largest >= model_config.vocab_size:
        raise DataError(
            f"the data holds token id {largest} but the model's vocab_size is "
            f"{model_config.vocab_size}; pass --vocab-size {largest + 1} or more"
        )
    if config.seq_len > model_config.max_seq_len:
        raise ValueError(
            f"--seq-len {config.seq_len} exceeds the {config.preset!r} preset's max_seq_len "
            f"{model_config.max_seq_len}; pass a shorter --seq-len"
        )
    return replace(model_config, seed=config.seed)


def _check(config: TrainConfig) -> None:
    for name in ("steps", "batch_size", "seq_len", "log_every"):
        if getattr(config, name) < 1:
            raise ValueError(
                f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}"
            )
    if not (config.lr > 0 and math.isfinite(config.lr)):
        raise ValueError(f"--lr must be a positive number, got {config.lr}")
    if config.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {config.warmup}")
    if config.save_every < 0 or (config.keep is not None and config.keep < 1):
        raise ValueError(
            f"--save-every must be >= 0 and --keep >= 1, got {config.save_every} and {config.keep}"
        )


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def train(config: TrainConfig, console: Console | None = None) -> list[dict[str, float]]:
    """Train a Llama preset and write ``metrics.jsonl``, ``loss.png`` and ``config.json``.

    With ``save_every``, train-state checkpoints (params, optimizer state, data position,
    RNG) go to ``out/checkpoints`` asynchronously; with ``resume``, the run continues from
    the latest complete one there and gives the losses an uninterrupted run would.

    Args:
        config: The run's options.
        console: Where the progress bar goes (default: standard output).

    Returns:
        One record per step run by this call: ``step``, ``loss``, ``lr``, ``tokens_per_s``,
        ``elapsed_s``.

    Raises:
        DataError: The data path is missing or empty, or holds ids past the vocab.
        ValueError: An option is out of range.
    """
    _check(config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise ValueError(
            f"d9d train runs on one process for now (WORLD_SIZE={world}); launch with "
            "`torchrun --nproc-per-node 1` or plain `d9d train`"
        )
    tokens = _tokens(config)
    loader = data.TokenLoader(
        tokens, global_batch_size=config.batch_size, seq_len=config.seq_len, seed=config.seed
    )
    model_config = _model_config(config, loader.tokens)
    device = _device()
    model = functionalize(Llama(model_config, device=device))
    opt = _optimizer(config)
    step = make_train_step(model, opt)
    if config.jit:
        step = jit(step)
    params = {k: v.clone() for k, v in model.params.items()}
    opt_state = opt.init(params)
    first_step = 0
    latest = checkpoint.latest(config.out / "checkpoints") if config.resume else None
    if latest is not None:
        state = checkpoint.restore_train_state(latest, params=params, opt_state=opt_state)
        params, opt_state, first_step = state.params, state.opt_state, state.step
        loader.load_state_dict(state.data)
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "config.json").write_text(
        json.dumps(asdict(config), default=str, indent=2) + "\n"
    )
    saver = _Checkpointer(config)
    try:
        records = _loop(
            config, step, params, opt_state, loader, device, console or Console(), first_step, saver
        )
    finally:
        saver.wait()  # even after a crash, the checkpoint in flight gets committed
    logged = [json.loads(r) for r in (config.out / "metrics.jsonl").read_text().splitlines()]
    _plot(logged, config.out / "loss.png", title=f"d9d train --preset {config.preset}")
    return records


class _Checkpointer:
    """Train-state checkpoints every ``save_every`` steps, one asynchronous save at a time."""

    def __init__(self, config: TrainConfig) -> None:
        self._config = config
        self._pending: checkpoint.SaveHandle | None = None

    def maybe_save(self, step: int, params: Any, opt_state: Any, loader: data.TokenLoader) -> None:
        every = self._config.save_every
        if every and step % every == 0:
            self.wait()
            self._pending = checkpoint.save_train_state(
                self._config.out / "checkpoints",
                step=step,
                params=params,
                opt_state=opt_state,
                data=loader.state_dict(),
                keep=self._config.keep,
            )

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None


def _metrics_log(path: Path, first_step: int) -> TextIO:
    """The metrics file; when resuming, keeps the records up to ``first_step`` and appends."""
    if first_step == 0 or not path.exists():
        return path.open("w")
    kept = [r for r in path.read_text().splitlines() if json.loads(r)["step"] <= first_step]
    path.write_text("".join(r + "\n" for r in kept))
    return path.open("a")


def _loop(
    config: TrainConfig,
    step: Callable[..., Any],
    params: Any,
    opt_state: Any,
    loader: data.TokenLoader,
    device: torch.device,
    console: Console,
    first_step: int,
    saver: _Checkpointer,
) -> list[dict[str, float]]:
    records: list[dict[str, float]] = []
    tokens_per_step = config.batch_size * config.seq_len
    progress = Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[tok_s]:,.0f} tok/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    start = time.perf_counter()
    with progress, _metrics_log(config.out / "metrics.jsonl", first_step) as log:
        task = progress.add_task(
            "train", total=config.steps, completed=first_step, loss=float("nan"), tok_s=0.0
        )
        last, last_step = start, first_step
        for i in range(first_step, config.steps):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(loader).items()}
            params, opt_state, metrics = step(params, opt_state, batch)
            saver.maybe_save(i + 1, params, opt_state, loader)
            if (i + 1) % config.log_every and i + 1 != config.steps:
                progress.advance(task)
                continue
            loss = float(metrics["loss"])
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"loss is {loss} at step {i + 1}; lower --lr or check the data"
                )
            now = time.perf_counter()
            record = {
                "step": i + 1,
                "loss": loss,
                "lr": float(optim.get_state(opt_state, "learning_rate")),
                "tokens_per_s": tokens_per_step * (i + 1 - last_step) / (now - last),
                "elapsed_s": now - start,
            }
            last, last_step = now, i + 1
            records.append(record)
            log.write(json.dumps(record) + "\n")
            progress.update(task, advance=1, loss=loss, tok_s=record["tokens_per_s"])
    return records


def _plot(records: list[dict[str, float]], path: Path, *, title: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 3.5), dpi=120, layout="tight")
    axis = figure.add_subplot()
    axis.plot([r["step"] for r in records], [r["loss"] for r in records], linewidth=1.2)
    axis.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    axis.grid(alpha=0.3)
    figure.savefig(path)
