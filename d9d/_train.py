"""The training loop behind ``d9d train``: a Llama preset on a token corpus, on one process or
on every rank of a ``torchrun`` job (FSDP over ``--fsdp`` ranks, replicated over ``--dp``,
tensor, context and pipeline parallel over ``--tp``, ``--cp``, ``--pp``)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from . import checkpoint, data, losses, optim
from ._autodiff import value_and_grad
from ._jit import jit
from ._mesh import make_mesh
from ._module import Model, functionalize
from ._pipeline_run import SCHEDULES
from ._process_group import init_process_group
from ._step import TransformedStep
from .errors import DataError
from .models import Llama, LlamaConfig
from .transforms import context_parallel, pipeline, shard_params, tensor_parallel

__all__ = ["TrainConfig", "make_train_step", "train"]


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
    dp: int | None = None  # ranks the model is replicated over (HSDP/DDP); None: 1
    fsdp: int | None = None  # ranks the model is sharded over; None: the rest of the world
    tp: int | None = None  # tensor-parallel ranks (Megatron TP, sequence parallel); None: 1
    cp: int | None = None  # context-parallel ranks (ring attention); None: 1
    pp: int | None = None  # pipeline stages; None: 1
    schedule: str = "1f1b"  # pipeline schedule, with --pp
    microbatches: int | None = None  # pipeline microbatches per step; None: 2 x pp
    dist_timeout: float = 600.0  # seconds a collective or store wait may block under torchrun


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


def _model_config(config: TrainConfig, tokens: np.ndarray) -> LlamaConfig:
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


def _loader(
    config: TrainConfig, tokens: Any, dp_rank: int = 0, dp_size: int = 1
) -> data.TokenLoader:
    return data.TokenLoader(
        tokens,
        global_batch_size=config.batch_size,
        seq_len=config.seq_len,
        seed=config.seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


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
    for name in ("dp", "fsdp", "tp", "cp", "pp", "microbatches"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(config, name)}")
    if config.jit and (config.pp or 1) > 1:
        raise ValueError(
            "--jit does not compile a pipeline step (its schedule runs eagerly); drop --jit or --pp"
        )
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
    started_group = _init_distributed(config)
    try:
        records = _train(config, console)
    except BaseException:
        if started_group:
            dist.destroy_process_group()
        raise
    if started_group:
        # Ranks leave together: rank 0 is still plotting when the others finish, and a gloo
        # rank tearing its groups down while a peer is busy has aborted (SIGABRT) in CI.
        dist.barrier()
        dist.destroy_process_group()
    return records


def _init_distributed(config: TrainConfig) -> bool:
    """Join the torchrun job when there is one; whether this call started the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = {name: getattr(config, name) for name in _AXES if getattr(config, name)}
    if (world == 1 and not layout) or dist.is_initialized():
        return False
    if "RANK" not in os.environ:
        flags = ", ".join(f"{k}={v}" for k, v in layout.items())
        raise ValueError(
            f"--dp/--fsdp/--tp/--cp/--pp need several ranks: launch with `torchrun "
            f"--nproc-per-node N -m d9d train ...` (got {flags} in one process)"
        )
    init_process_group(timeout=timedelta(seconds=config.dist_timeout))
    return True


_AXES = ("pp", "dp", "fsdp", "cp", "tp")


def _parallel(config: TrainConfig, step: Callable[..., Any]) -> Any:
    """``step`` under the transforms of the job's ``pp x dp x fsdp x cp x tp`` mesh (``fsdp``:
    the ranks the others leave), or as it is outside a job."""
    if not dist.is_initialized():
        return step
    world = dist.get_world_size()
    sizes = {name: getattr(config, name) or 1 for name in _AXES if name != "fsdp"}
    others = math.prod(sizes.values())
    fsdp = config.fsdp or max(world // others, 1)
    if others * fsdp != world:
        product = " x ".join(f"--{k} {v}" for k, v in {**sizes, "fsdp": fsdp}.items())
        raise ValueError(
            f"{product} is {others * fsdp} ranks but torchrun started {world}; make their "
            "product the number of ranks"
        )
    # Only the axes in use: DTensor's sharding propagation slows down steeply with the
    # number of mesh dims (a foreach op on a 5-D mesh takes minutes to plan).
    axes = {name: size for name, size in {**sizes, "fsdp": fsdp}.items() if size > 1}
    mesh = make_mesh(**(axes or {"fsdp": 1}))
    if "dp" in axes or "fsdp" in axes:
        shard_axis = "fsdp" if "fsdp" in axes else None
        step = shard_params(mesh, shard_axis, replicate_axis="dp" if "dp" in axes else None)(step)
    if sizes["tp"] > 1:
        step = tensor_parallel(mesh)(step)
    if sizes["cp"] > 1:
        step = context_parallel(mesh)(step)
    if sizes["pp"] > 1:
        step = pipeline(
            mesh,
            schedule=config.schedule,
            microbatches=config.microbatches or 2 * sizes["pp"],
            virtual_stages=2 if SCHEDULES[config.schedule].multi else 1,
        )(step)
    return step


def _train(config: TrainConfig, console: Console | None) -> list[dict[str, float]]:
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    loader = _loader(config, _tokens(config))
    model_config = _model_config(config, loader.tokens)
    device = _device()
    model = functionalize(Llama(model_config, device=device))
    opt = _optimizer(config)
    step = _parallel(config, make_train_step(model, opt))
    params = {k: v.clone() for k, v in model.params.items()}
    opt_state = opt.init(params)
    if isinstance(step, TransformedStep):
        params, opt_state = step.place(params, opt_state, model=model)
        loader = _loader(config, loader.tokens, *step.batch_shard())
    if config.jit:
        step = jit(step)
    first_step = 0
    latest = checkpoint.latest(config.out / "checkpoints") if config.resume else None
    if latest is not None:
        state = checkpoint.restore_train_state(
            latest,
            params=params,
            opt_state=opt_state,
            partial=(config.pp or 1) > 1,  # a pipeline rank restores its stage's params only
        )
        params, opt_state, first_step = state.params, state.opt_state, state.step
        loader.load_state_dict(state.data)
    if rank0:
        config.out.mkdir(parents=True, exist_ok=True)
        (config.out / "config.json").write_text(
            json.dumps(asdict(config), default=str, indent=2) + "\n"
        )
    saver = _Checkpointer(config)
    try:
        records = _loop(
            config,
            step,
            params,
            opt_state,
            loader,
            device,
            console or Console(),
            first_step,
            saver,
            rank0,
        )
    finally:
        saver.wait()  # even after a crash, the checkpoint in flight gets committed
    if rank0:
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
    rank0: bool,
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
        disable=not rank0,
    )
    start = time.perf_counter()
    log_path = config.out / "metrics.jsonl" if rank0 else Path(os.devnull)
    with progress, _metrics_log(log_path, first_step) as log:
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
