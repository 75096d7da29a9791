"""The training loop behind ``d9d train``: a Llama preset on a token corpus, on one process or
on every rank of a ``torchrun`` job (FSDP over ``--fsdp`` ranks, replicated over ``--dp``,
tensor, context and pipeline parallel over ``--tp``, ``--cp``, ``--pp``)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console

from .. import checkpoint, data, losses, optim
from .._autodiff import value_and_grad
from .._mesh import make_mesh
from .._model import Model, functionalize
from .._process_group import init_process_group
from .._step import TransformedStep
from ..errors import DataError
from ..models import Llama, LlamaConfig, MoE, MoEConfig
from ..models.moe import make_train_step as make_moe_train_step
from ..transforms import (
    context_parallel,
    expert_parallel,
    fp8,
    pipeline,
    shard_params,
    tensor_parallel,
)
from ..transforms.pipeline import SCHEDULES
from . import _train_resume as resume
from ._config import TrainConfig
from ._flops import train_flops_per_token
from ._train_checkpoints import Checkpointer, check_finite
from ._train_checks import check_flags as _check
from ._train_data import training_tokens
from ._train_eval import Evaluator, split_held_out
from ._train_log import MetricsLog
from ._train_metrics import SpeedMeter, peak_memory
from ._train_out import check_fresh_out
from ._train_precision import ZERO_SHARDS, opt_state_dtype, shard_options
from ._train_preempt import Preemption
from ._train_profile import StepProfiler
from ._train_progress import TrainProgress
from ._train_report import header_lines, print_header
from ._train_watch import Dashboards

__all__ = ["TrainConfig", "TrainRun", "make_train_step", "train"]


def make_train_step(
    model: Model, opt: optim.GradientTransformation, *, grad_norm: bool = False
) -> Callable[..., Any]:
    """The step ``d9d train`` runs: next-token cross entropy, grads, one optimizer update.

    Args:
        model: A functionalized language model: ``model.apply(params, tokens) -> logits``.
        opt: The optimizer.
        grad_norm: Also return the global norm of the gradients, before clipping (one more
            norm over the grads per step; ``d9d train`` checks it). Default ``False``.

    Returns:
        ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` where ``batch``
        holds ``"tokens"`` and ``"labels"`` of shape ``[batch, seq_len]`` and ``metrics``
        the 0-d ``"loss"`` (and ``"grad_norm"``), equal on every rank.

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
        metrics = {"loss": loss}
        if grad_norm:
            metrics["grad_norm"] = optim.global_norm(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, metrics

    return step


def _optimizer(config: TrainConfig) -> optim.GradientTransformation:
    schedule = optim.warmup_cosine(
        config.lr,
        min(config.warmup, config.steps - 1),
        max(config.steps, 2),
        end_value=config.lr / 10,
    )
    moments = opt_state_dtype(config)
    return optim.chain(
        optim.clip_by_global_norm(config.clip),
        optim.adamw(
            schedule,
            b2=0.95,
            weight_decay=config.weight_decay,
            mask=_decays,
            mu_dtype=moments,
            nu_dtype=moments,
        ),
    )


def _decays(path: str, param: torch.Tensor) -> bool:
    return param.ndim >= 2


def _model_config(config: TrainConfig, tokens: np.ndarray) -> LlamaConfig | MoEConfig:
    model_config = (MoEConfig if config.model == "moe" else LlamaConfig).preset(config.preset)
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


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


@dataclass(frozen=True)
class TrainRun:
    """What one call of :func:`train` did.

    Attributes:
        records: One record per step logged by this call: ``step``, ``loss``,
            ``grad_norm``, ``lr``, ``tokens_per_s``, ``step_time_s``, ``elapsed_s``, the peak
            memory (``peak_memory_gib`` on GPU, ``peak_rss_gib`` on CPU), ``mfu`` on a GPU of
            known peak, ``aux_loss`` and ``load_balance`` of an MoE, and ``eval_loss`` and
            ``eval_perplexity`` at evaluated steps.
        first_step: Steps done before this call (the restored checkpoint's step, or 0).
        last_step: Steps done after it.
        preempted: A SIGTERM stopped the run after ``last_step``, whose checkpoint is
            committed (``d9d train`` then exits with 143).
    """

    records: list[dict[str, float]] = field(default_factory=list)
    first_step: int = 0
    last_step: int = 0
    preempted: bool = False


def train(config: TrainConfig, console: Console | None = None) -> TrainRun:
    """Train a Llama preset and write ``metrics.jsonl``, ``loss.png`` and ``config.json``
    (and TensorBoard events, a W&B run, a profiler trace, as ``config`` asks).

    With ``save_every``, train-state checkpoints (params, optimizer state, data position,
    RNG) go to ``out/checkpoints`` asynchronously, each only after its step's loss and
    gradient norm were found finite; with ``resume``, the run continues from the newest
    readable one there (``resume_from``: from that one) and gives the losses and
    ``metrics.jsonl`` an uninterrupted run would.

    Args:
        config: The run's options.
        console: Where the progress bar goes (default: standard output).

    Returns:
        A :class:`TrainRun` of the steps this call ran.

    Raises:
        DataError: The data path is missing or empty, or holds ids past the vocab.
        ValueError: An option is out of range.
        ConfigError: Resuming with a flag that changes the schedule or the model, or
            ``out`` holds a run and neither ``resume`` nor ``resume_from`` is given.
        CheckpointCorruptError: ``resume_from`` is damaged, or every checkpoint is.
        FloatingPointError: A loss or gradient norm is not finite (that step is not saved).
    """
    _check(config)
    started_group = _init_distributed(config)
    try:
        check_fresh_out(config.out, resuming=config.resume or config.resume_from is not None)
        run = _train(config, console)
    except BaseException:
        if started_group:
            dist.destroy_process_group()
        raise
    if started_group:
        # Ranks leave together: rank 0 is still plotting when the others finish, and a gloo
        # rank tearing its groups down while a peer is busy has aborted (SIGABRT) in CI.
        dist.barrier()
        dist.destroy_process_group()
    return run


def _init_distributed(config: TrainConfig) -> bool:
    """Join the torchrun job when there is one; whether this call started the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = {name: getattr(config, name) for name in _AXES if getattr(config, name)}
    needs_mesh = bool(shard_options(config)) or config.fp8 is not None
    if (world == 1 and not layout and not needs_mesh) or dist.is_initialized():
        return False
    if "RANK" not in os.environ and not layout:  # --dtype, --grad-accum, --fp8: a one-rank group
        make_mesh(fsdp=1)
        return True
    if "RANK" not in os.environ:
        flags = ", ".join(f"{k}={v}" for k, v in layout.items())
        raise ValueError(
            f"--dp/--fsdp/--ep/--tp/--cp/--pp need several ranks: launch with `torchrun "
            f"--nproc-per-node N -m d9d train ...` (got {flags} in one process)"
        )
    init_process_group(timeout=timedelta(seconds=config.dist_timeout))
    return True


_AXES = ("pp", "dp", "fsdp", "ep", "cp", "tp")


def _parallel(config: TrainConfig, step: Callable[..., Any]) -> Any:
    """``step`` under the transforms of the job's ``pp x dp x fsdp x cp x tp`` mesh (``fsdp``:
    the ranks the others leave), or as it is outside a job."""
    if config.zero != 3 and not dist.is_initialized():
        raise ValueError(
            f"--zero {config.zero} shards over --fsdp ranks, and this is one process: launch "
            "with `torchrun --nproc-per-node N -m d9d train ...`, or drop --zero"
        )
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
    options = shard_options(config)
    if options and not {"dp", "fsdp"} & set(axes):
        axes["fsdp"] = 1  # shard_params' precision and accumulation, over one rank
    if config.zero != 3 and "fsdp" not in axes:
        raise ValueError(
            f"--zero {config.zero} shards over --fsdp, which is 1 here; give --fsdp more "
            "ranks, or drop --zero"
        )
    mesh = make_mesh(**(axes or {"fsdp": 1}))
    if "dp" in axes or "fsdp" in axes:
        shard_axis = "fsdp" if "fsdp" in axes else None
        replicate_axis = "dp" if "dp" in axes else None
        if shard_axis is not None:
            options["shard"] = ZERO_SHARDS[config.zero]
        step = shard_params(mesh, shard_axis, replicate_axis=replicate_axis, **options)(step)
    if sizes["tp"] > 1:
        step = tensor_parallel(mesh)(step)
    if sizes["cp"] > 1:
        step = context_parallel(mesh)(step)
    if sizes["ep"] > 1:
        step = expert_parallel(mesh)(step)
    if config.fp8 is not None:
        step = fp8(mesh, config.fp8)(step)
    if sizes["pp"] > 1:
        step = pipeline(
            mesh,
            schedule=config.schedule,
            microbatches=config.microbatches or 2 * sizes["pp"],
            virtual_stages=2 if SCHEDULES[config.schedule].multi else 1,
        )(step)
    return step


def _config_json(config: TrainConfig) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(config), default=str))


def _train(config: TrainConfig, console: Console | None) -> TrainRun:
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    config = replace(config, warmup=min(config.warmup, config.steps - 1))  # what the schedule uses
    directory = config.out / "checkpoints"
    resuming = config.resume or config.resume_from is not None
    if resuming and (config.resume_from or checkpoint.all_checkpoints(directory)):
        source = config.resume_from.parent if config.resume_from else directory
        resume.check_unchanged(
            _config_json(config), source.parent / "config.json", allow=config.allow_config_change
        )
    if rank0:  # no save is in flight yet: whatever is unfinished is a dead run's
        for path in checkpoint.sweep(directory):
            resume.say(f"removed {str(path)!r}, left by an interrupted save")
    loader = _loader(config, training_tokens(config.data))
    model_config = _model_config(config, loader.tokens)
    if config.eval_every:
        train_tokens, held_out = split_held_out(loader.tokens, config.eval_fraction)
        loader = _loader(config, train_tokens)
    device = _device()
    moe = config.model == "moe"
    model = functionalize((MoE if moe else Llama)(model_config, device=device))
    opt = _optimizer(config)
    step = _parallel(
        config, (make_moe_train_step if moe else make_train_step)(model, opt, grad_norm=True)
    )
    params = {k: v.clone() for k, v in model.params.items()}
    opt_state = opt.init(params)
    if isinstance(step, TransformedStep):
        params, opt_state = step.place(params, opt_state, model=model)
        loader = _loader(config, loader.tokens, *step.data_rank())
    evaluator = None
    if config.eval_every:
        evaluator = Evaluator(
            model,
            step,
            held_out,
            batches=config.eval_batches,
            batch_size=config.batch_size,
            seq_len=config.seq_len,
            device=device,
        )
    if rank0:  # before jit, which hides the transformed step's mesh
        held = held_out.size if config.eval_every else 0
        rows = header_lines(config, model_config, model, step, loader.tokens.size, held, device)
        print_header(console or Console(), rows)
    if config.jit:
        from .._jit import jit  # inductor's import costs each eager rank about 2 s

        step = jit(step)

    def restore_one(path: Path, restore_rng: bool) -> checkpoint.TrainState:
        return checkpoint.restore_train_state(
            path,
            params=params,
            opt_state=opt_state,
            restore_rng=restore_rng,
            partial=(config.pp or 1) > 1,  # a pipeline rank restores its stage's params only
        )

    first_step = 0
    state = resume.restore(directory, config.resume_from, restore_one) if resuming else None
    if state is not None:
        params, opt_state, first_step = state.params, state.opt_state, state.step
        loader.load_state_dict(state.data)
        resume.set_aside_newer(directory, first_step)
    if rank0:
        config.out.mkdir(parents=True, exist_ok=True)
        (config.out / "config.json").write_text(json.dumps(_config_json(config), indent=2) + "\n")
    saver = Checkpointer(config.out / "checkpoints", config.save_every, config.keep)
    log_path = config.out / "metrics.jsonl" if rank0 else None
    rank = dist.get_rank() if dist.is_initialized() else 0
    speed = SpeedMeter(
        config.batch_size * config.seq_len,
        train_flops_per_token(model_config, config.seq_len),
        device,
        dist.get_world_size() if dist.is_initialized() else 1,
    )
    profile_steps = config.profile_steps if config.profile else 0
    try:
        with (
            Preemption() as preemption,
            MetricsLog(log_path, first_step) as log,
            Dashboards(config, _config_json(config), first_step, rank0) as dashboards,
            TrainProgress(console or Console(), config.steps, first_step, show=rank0) as progress,
            StepProfiler(
                config.out / "profile" / f"rank{rank}.json", first_step, profile_steps
            ) as profiler,
        ):
            watch = _Watch(log, dashboards, progress, speed, evaluator, profiler, preemption)
            records = _loop(
                config, step, params, opt_state, loader, device, first_step, saver, watch
            )
            saver.wait()  # the last checkpoint commits while SIGTERM is still handled
    finally:
        saver.wait()  # even after a crash, the checkpoint in flight gets committed
    if rank0:
        logged = [json.loads(r) for r in (config.out / "metrics.jsonl").read_text().splitlines()]
        _plot(logged, config.out / "loss.png", title=f"d9d train --preset {config.preset}")
    if preemption.stopped_at is not None:
        return TrainRun(records, first_step, preemption.stopped_at, preempted=True)
    return TrainRun(records, first_step, max(first_step, config.steps))


@dataclass(frozen=True)
class _Watch:
    """Where a logged step goes and what else runs beside the steps."""

    log: MetricsLog
    dashboards: Dashboards
    progress: TrainProgress
    speed: SpeedMeter
    evaluator: Evaluator | None
    profiler: StepProfiler
    preemption: Preemption


def _loop(
    config: TrainConfig,
    step: Callable[..., Any],
    params: Any,
    opt_state: Any,
    loader: data.TokenLoader,
    device: torch.device,
    first_step: int,
    saver: Checkpointer,
    watch: _Watch,
) -> list[dict[str, float]]:
    records: list[dict[str, float]] = []
    start = time.perf_counter()
    last, last_step = start, first_step
    for i in range(first_step, config.steps):
        batch = {k: v.to(device, non_blocking=True) for k, v in next(loader).items()}
        watch.profiler.before(i)
        params, opt_state, metrics = step(params, opt_state, batch)
        watch.profiler.after(i)
        n, saving = i + 1, saver.due(i + 1)
        stopping = watch.preemption.agreed() and n < config.steps  # SIGTERM on some rank
        evaluating = watch.evaluator is not None and n % config.eval_every == 0
        logging = n % config.log_every == 0 or n == config.steps or evaluating
        if not (saving or logging or stopping or saver.held is not None):
            watch.progress.advance()
            continue
        try:  # every rank sees the same loss and norm, so decides the same
            loss, grad_norm = check_finite(n, metrics, saver)
        except FloatingPointError:
            saver.discard()
            raise
        saver.vouch()
        record = None
        if logging:
            now = time.perf_counter()
            record = {
                "step": n,
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": float(optim.get_state(opt_state, "learning_rate")),
                **watch.speed.measure(n - last_step, now - last),
                "elapsed_s": now - start,
                **peak_memory(device),
            }
            record |= {k: float(metrics[k]) for k in ("aux_loss", "load_balance") if k in metrics}
            if evaluating:
                record |= watch.evaluator(params)
            last, last_step = time.perf_counter(), n  # the next speed leaves the eval out
            records.append(record)
            watch.log.write(record)
            watch.dashboards.write(record)
        if saving or stopping:
            watch.log.sync()  # the records up to a committed checkpoint are on disk
            saver.save(n, params, opt_state, loader)
        if stopping:
            watch.preemption.stop(n, config.steps, saver.commit_now())
            break
        watch.progress.advance(loss, record)
    return records


def _plot(records: list[dict[str, float]], path: Path, *, title: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 3.5), dpi=120, layout="tight")
    axis = figure.add_subplot()
    axis.plot([r["step"] for r in records], [r["loss"] for r in records], linewidth=1.2)
    axis.set(xlabel="step", ylabel="loss (nats/token)", title=title)
    axis.grid(alpha=0.3)
    figure.savefig(path)
