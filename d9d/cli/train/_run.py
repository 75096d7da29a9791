"""The training loop behind ``d9d train``: a Llama preset on a token corpus, on one process or
on every rank of a ``torchrun`` job (FSDP over ``--fsdp`` ranks, replicated over ``--dp``,
tensor, context and pipeline parallel over ``--tp``, ``--cp``, ``--pp``)."""

from __future__ import annotations

import json
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

from ... import checkpoint, data, optim
from ...core._mesh import make_mesh
from ...core._model import functionalize
from ...core._step import OutermostStep, TransformedStep
from ...errors import ConfigError, DataError
from ...launch._process_group import init_process_group
from ...models import Llama, LlamaConfig, MoE, MoEConfig
from ...models.moe import make_train_step as make_moe_train_step
from ...transforms.diloco import DiLoCoStep
from .._config import TrainConfig
from .._flops import train_flops_per_token
from .._precision import shard_options, stored_params
from .._train_step import _AXES, _optimizer, _parallel, make_train_step, pipeline_microbatches
from . import _resume as resume
from ._checkpoints import Checkpointer, check_finite
from ._checks import check_flags as _check
from ._data import training_tokens
from ._eval import Evaluator, split_held_out
from ._log import MetricsLog
from ._metrics import SpeedMeter, peak_memory
from ._out import check_fresh_out, lock_out
from ._preempt import Preemption
from ._profile import StepProfiler
from ._progress import TrainProgress
from ._replica_group import ReplicaGroup, join_replica_group
from ._report import header_lines, print_header
from ._watch import Dashboards

__all__ = ["TrainRun", "train"]


def _model_config(config: TrainConfig, tokens: np.ndarray) -> LlamaConfig | MoEConfig:
    model_config = (MoEConfig if config.model == "moe" else LlamaConfig).preset(config.preset)
    if config.vocab_size is not None:
        model_config = replace(model_config, vocab_size=config.vocab_size)
    uint16_file = isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    if uint16_file and model_config.vocab_size > 2**16:
        raise DataError(
            f"the model's vocab_size is {model_config.vocab_size}, but --data is read as "
            "uint16 token ids, which hold only 65,536 ids: a file written with wider ids "
            "would be read as pairs of wrong ids; pass --token-dtype uint32 if it holds "
            "uint32 ids, or --vocab-size 65536 or less for uint16 ids"
        )
    largest = int(tokens.max())
    if largest >= model_config.vocab_size:
        raise DataError(
            f"the data holds token id {largest} but the model's vocab_size is "
            f"{model_config.vocab_size}; pass --vocab-size {largest + 1} or more"
            + (
                " (or --token-dtype uint16, if the file holds uint16 ids: read as uint32, "
                "each pair of them is one id)"
                if largest >= 2**16 and tokens.dtype == np.uint32
                else ""
            )
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
            known peak (with ``--fp8``: against the fp8 peak, and ``mfu_bf16``),
            ``aux_loss`` and ``load_balance`` of an MoE, and ``eval_loss`` and
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
        DataError: The data path is missing or empty, holds ids past the vocab, or is a
            token file whose dtype holds fewer ids than the vocab.
        ValueError: An option is out of range.
        ConfigError: Resuming with a flag that changes the schedule or the model,
            ``out`` holds a run and neither ``resume`` nor ``resume_from`` is given, or
            another run is writing into ``out``.
        CheckpointCorruptError: ``resume_from`` is damaged, or every checkpoint is.
        FloatingPointError: A loss or gradient norm is not finite (that step is not saved).
    """
    _check(config)
    started_group = _init_distributed(config)
    replica, out_lock = None, None
    try:
        out_lock = lock_out(config.out)  # held until the run's last write: one run at a time
        replica = join_replica_group(config) if config.fault_tolerant else None
        check_fresh_out(
            config.out,
            resuming=config.resume or config.resume_from is not None,
            replica_group=config.replica_group_id if config.fault_tolerant else None,
        )
        run = _train(config, console, replica)
    except BaseException:
        if out_lock is not None:
            out_lock.release()
        if replica is not None:
            replica.close()
        if started_group:
            dist.destroy_process_group()
        raise
    out_lock.release()
    if replica is not None:
        replica.close()
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


def _transformed(step: Any) -> Any:
    """The step under ``diloco`` and ``jit``, if any."""
    while isinstance(step, OutermostStep):
        step = step.step
    return step


def _jit(step: Any) -> Any:
    from ...core._jit import jit  # inductor's import costs each eager rank about 2 s

    return jit(step)


def _config_json(config: TrainConfig) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(config), default=str))


def _train(config: TrainConfig, console: Console | None, replica: ReplicaGroup | None) -> TrainRun:
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    config = replace(config, warmup=min(config.warmup, config.steps - 1))  # what the schedule uses
    directory = config.out / "checkpoints"
    resuming = config.resume or config.resume_from is not None
    if config.resume_from is not None:
        resume.check_is_checkpoint(config.resume_from)
    if resuming and (config.resume_from or checkpoint.all_checkpoints(directory)):
        source = config.resume_from.parent if config.resume_from else directory
        resume.check_unchanged(
            _config_json(config), source.parent / "config.json", allow=config.allow_config_change
        )
    if rank0:  # no save is in flight yet: whatever is unfinished is a dead run's
        for path in checkpoint.sweep(directory):
            resume.say(f"removed {str(path)!r}, left by an interrupted save")
    loader = _loader(config, training_tokens(config.data, config.token_dtype))
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
    if config.jit and config.diloco is not None:  # diloco compiles its inner step, not its rounds
        step = _jit(step if isinstance(step, TransformedStep) else TransformedStep(step, ()))
    if replica is not None:
        step = replica.wrap(step)
    params = stored_params(config, {k: v.clone() for k, v in model.params.items()})
    opt_state = opt.init(params)
    if isinstance(step, TransformedStep | DiLoCoStep):
        params, opt_state = step.place(params, opt_state, model=model)
        data_rank, data_ranks = _data_rank(step, replica, config)
        loader = _loader(config, loader.tokens, data_rank, data_ranks)
        _check_microbatches(config, data_ranks)
    if replica is not None:
        replica.follow(loader)
    evaluator = None
    if config.eval_every:
        evaluator = Evaluator(
            model,
            _transformed(step),  # the inner step's plan, under diloco
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
    if config.jit and config.diloco is None:
        step = _jit(step)

    def restore_one(path: Path, restore_rng: bool) -> checkpoint.TrainState:
        state = checkpoint.restore_train_state(
            path,
            params=params,
            opt_state=opt_state,
            restore_rng=restore_rng,
            partial=(config.pp or 1) > 1,  # a pipeline rank restores its stage's params only
        )
        resume.load_data_position(loader, state.data, path)  # before "resumed from" is said
        return state

    first_step = 0
    state = resume.restore(directory, config.resume_from, restore_one) if resuming else None
    if state is not None:
        params, opt_state, first_step = state.params, state.opt_state, state.step
        resume.set_aside_newer(directory, first_step)
        if replica is not None:  # the groups behind the one furthest ahead heal from it
            replica.resume_at(first_step, params, opt_state, state.metadata)
    if rank0:
        config.out.mkdir(parents=True, exist_ok=True)
        (config.out / "config.json").write_text(json.dumps(_config_json(config), indent=2) + "\n")
    saver = Checkpointer(config.out / "checkpoints", config.save_every, config.keep)
    log_path = config.out / "metrics.jsonl" if rank0 else None
    # A replica group learns the step it starts at from its first quorum.
    log_from = None if replica is not None else first_step
    rank = dist.get_rank() if dist.is_initialized() else 0
    speed = SpeedMeter(
        config.batch_size * config.seq_len,
        train_flops_per_token(model_config, config.seq_len),
        device,
        dist.get_world_size() if dist.is_initialized() else 1,
        fp8=config.fp8 is not None,
    )
    profile_steps = config.profile_steps if config.profile else 0
    try:
        with (
            Preemption() as preemption,
            MetricsLog(log_path, log_from) as log,
            Dashboards(config, _config_json(config), log_from, rank0) as dashboards,
            TrainProgress(console or Console(), config.steps, first_step, show=rank0) as progress,
            StepProfiler(
                config.out / "profile" / f"rank{rank}.json", first_step, profile_steps
            ) as profiler,
        ):
            watch = _Watch(
                log, dashboards, progress, speed, evaluator, profiler, preemption, replica
            )
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


def _check_microbatches(config: TrainConfig, data_ranks: int) -> None:
    """Refuse, naming the flags, a rank's rows that do not split into its microbatches."""
    splits = {"--grad-accum": config.grad_accum, "--microbatches": pipeline_microbatches(config)}
    rows = config.batch_size // data_ranks
    for flag, count in splits.items():
        if count > 1 and rows % count:
            by_default = flag == "--microbatches" and config.microbatches is None
            default = " (2 x --pp by default)" if by_default else ""
            raise ConfigError(
                f"--batch-size {config.batch_size} gives each of the {data_ranks} "
                f"data-parallel rank(s) {rows} sequences, which do not split into {flag} "
                f"{count}{default} microbatches; pass a --batch-size that is a multiple of "
                f"{data_ranks * count}, or another {flag}"
            )


def _data_rank(
    step: TransformedStep, replica: ReplicaGroup | None, config: TrainConfig
) -> tuple[int, int]:
    """This rank's index among the ranks that read different rows, and their count: with
    replica groups, the group's ranks come after those of the groups before it."""
    index, count = step.data_rank()
    if replica is None or config.replica_groups is None or config.replica_group_id is None:
        return index, count
    return config.replica_group_id * count + index, config.replica_groups * count


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
    replica: ReplicaGroup | None = None  # this rank's torchft replica group


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
    i, batch = first_step, None
    replica, started = watch.replica, False
    while i < config.steps:
        if replica is not None and (replica.start_step() or not started):
            # The first quorum says where this group starts: at 0, or where the live
            # groups are when it rejoins them (their data position too: the batch is read
            # after the quorum; under DiLoCo, after the outer round they were in).
            params, opt_state = replica.join(params, opt_state)
            i = last_step = replica.steps_done(opt_state)
            batch, started = None, True
            watch.log.keep_through(i)
            watch.dashboards.start_at(i)
            if i >= config.steps:
                break
        if batch is None:
            if replica is not None and replica.diloco is None:
                # A group that heals at this step's quorum runs it: it reads this batch.
                # (Under DiLoCo it takes the params after the step, and reads the next.)
                replica.position = loader.state_dict()
            batch = {k: v.to(device, non_blocking=True) for k, v in next(loader).items()}
        watch.profiler.before(i)
        params, opt_state, metrics = step(params, opt_state, batch)
        watch.profiler.after(i)
        if replica is not None and replica.diloco is None and replica.commits() == i:
            continue  # a replica group failed during the step: it runs again on this batch
        batch, i = None, i + 1
        if replica is not None:
            replica.position = None
        n, saving = i, saver.due(i)
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
            # A replica group saves committed steps only (a dropped one ran again above).
            metadata = {"torchft": replica.manager.state_dict()} if replica is not None else None
            saver.save(n, params, opt_state, loader, metadata)
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
