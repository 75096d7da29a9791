"""``d9d plan``: the sharding plan, per-rank memory and collectives of a layout, on a
simulated world.

The model is built on the meta device and the ranks are simulated (``fake_world``); the step
is ``d9d train``'s, under the transforms ``d9d train`` composes for the same flags, so the
plan printed is the one a run would use. Collectives come from running that step once on
meta tensors (``_dry_run``), under ``--pp`` the pipeline schedule too (its point-to-point
sends and receives complete at once on the simulated world). Activations: the formula of
``_activations`` where it covers the model and layout (d9d's Llama and MoE, without
``--pp``), else the bytes the same dry run's forward kept for its backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ... import losses
from ...core._autodiff import value_and_grad
from ...core._comm_count import CommStats
from ...core._mesh import make_mesh
from ...core._model import Model
from ...core._step import TransformedStep
from ...models import LlamaConfig, MoEConfig
from ...testing import fake_world
from ...transforms import remat as remat_transform
from ...transforms import shard_params
from ...transforms.pipeline import Pipeline, PipelineLayout, PipelineRuntime
from .._config import TrainConfig
from .._options import check_fp8_flags, check_offload_flags
from .._precision import stored_params
from .._train_step import _optimizer, _parallel, make_train_step, with_fp8
from ._activations import ActivationLayout, activation_bytes, in_flight, moe_activation_bytes
from ._checks import check_layout as _check
from ._dry_run import DryRun, dry_run, group_labels
from ._models import build_model
from ._report import human, render_comms, render_plan

__all__ = ["show_plan"]


@dataclass(frozen=True)
class _StepFlags:
    """``d9d train``'s flags that shape the step besides its layout: ``--opt-state-dtype``,
    ``--zero``, ``--master-weights``, ``--fp8`` with its options (``fp8``: those
    ``TrainConfig`` fields), and ``--offload-opt-state``."""

    opt_state_dtype: str = "float32"
    zero: int = 3
    master_weights: bool = False
    fp8: dict[str, Any] = field(default_factory=dict)
    offload_opt_state: bool = False


def show_plan(
    preset: str = "8b",
    *,
    model: str = "llama",
    hf_config: Path | None = None,
    dp: int = 1,
    fsdp: int | None = None,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    ep: int = 1,
    world: int | None = None,
    batch: int = 1,
    seq: int | None = None,
    remat: str = "none",
    schedule: str = "1f1b",
    microbatches: int | None = None,
    opt_state_dtype: str = "float32",
    zero: int = 3,
    master_weights: bool = False,
    offload_opt_state: bool = False,
    fp8: str | None = None,
    fp8_include: Sequence[str] = (),
    fp8_exclude: Sequence[str] = (),
    fp8_gather: bool = False,
    max_rows: int | None = 24,
) -> str:
    """The plan table, per-rank memory (AdamW) with activations, and collectives, as text.

    Args:
        preset: A ``LlamaConfig.preset`` (or, with ``model="moe"``, ``MoEConfig.preset``) name.
        model: ``"llama"`` or ``"moe"``.
        hf_config: A Hugging Face ``config.json`` to plan instead of a preset.
        dp, fsdp, tp, cp, pp: Mesh axis sizes, as ``d9d train`` takes them; ``fsdp`` None:
            the ranks the others leave of ``world`` (1 without ``world``).
        ep: Expert-parallel ranks (``model="moe"`` only); the all-to-all bytes of dispatch
            and combine are those of uniform routing (simulated ranks hold no routing).
        world: Ranks in all; None: the product of the axes.
        batch: Sequences per rank per microbatch.
        seq: Tokens per sequence (None: the model's max_seq_len, at most 4096).
        remat: ``"none"``, ``"selective"`` or ``"full"``: ``d9d.remat`` on every block.
        schedule: Pipeline schedule with ``pp`` (``d9d train --schedule``).
        microbatches: Pipeline microbatches per step with ``pp`` (default ``2 * pp``).
        opt_state_dtype: AdamW's moments' dtype, ``"float32"`` or ``"bfloat16"`` (``d9d
            train --opt-state-dtype``).
        zero: What ``fsdp`` shards (``d9d train --zero``): 3 params, grads and optimizer
            state; 2 grads and optimizer state; 1 optimizer state only.
        master_weights: Params stored in bfloat16 with float32 masters in the optimizer
            state (``d9d train --master-weights``).
        offload_opt_state: The optimizer state kept on the host (``d9d train
            --offload-opt-state``): its bytes are shown apart and left out of the total.
        fp8: ``d9d train --fp8``'s recipe (None: off); ``fp8_include``, ``fp8_exclude``:
            its ``--fp8-include``/``--fp8-exclude`` regexes; ``fp8_gather``: ``--fp8-gather``.
        max_rows: Rows of the table to show (the middle is elided); None shows all.

    Returns:
        The report; with ``pp`` it names rank 0's stages, and its collectives include the
        schedule's sends and receives of activations and their grads. The activation line
        says whether its figure is the formula's or measured on meta (docs/plan.md).

    Raises:
        ValueError: A size (``batch``, ``seq``, ``microbatches`` too) is below 1, the axes do
            not multiply to ``world``, ``ep > 1`` without ``model="moe"``, an unknown ``model``, ``preset`` or
            ``remat``, a dim that does not split, or a schedule that cannot run
            ``microbatches``; ``zero`` below 3 without ``fsdp`` ranks; an fp8 option
            without ``fp8``; ``offload_opt_state`` with ``pp`` or ``master_weights``.

    Example:
        >>> print(show_plan("tiny", fsdp=2, seq=64, max_rows=4).splitlines()[0])
        d9d plan: llama tiny (125.25 K params) on 2 simulated ranks: fsdp=2
    """
    sizes = _check(
        model, remat, hf_config, dp=dp, fsdp=fsdp, tp=tp, cp=cp, pp=pp, ep=ep, world=world
    )
    if zero != 3 and sizes["fsdp"] == 1:
        raise ValueError(f"--zero {zero} shards over --fsdp, which is 1 here; give it ranks")
    check_fp8_flags(fp8, fp8_include, fp8_exclude, fp8_gather)
    check_offload_flags(offload_opt_state, pp=pp, master_weights=master_weights)
    fp8_options = {
        "fp8": fp8,
        "fp8_include": tuple(fp8_include),
        "fp8_exclude": tuple(fp8_exclude),
        "fp8_gather": fp8_gather,
    }
    for name, value in (("batch", batch), ("seq", seq), ("microbatches", microbatches)):
        if name != "batch" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be an int >= 1, got {value!r}")
    chunks = microbatches or 2 * pp if pp > 1 else 1
    ranks = math.prod(sizes.values())
    with fake_world(ranks):
        functional, config, described = build_model(model, preset, hf_config)
        if seq is None:  # the model's longest sequence, at most 4096
            longest = getattr(config, "max_seq_len", None) or getattr(
                getattr(functional.module, "config", None), "max_position_embeddings", None
            )
            seq = min(4096, longest or 4096)
        flags = _StepFlags(opt_state_dtype, zero, master_weights, fp8_options, offload_opt_state)
        step, opt = _step(functional, sizes, model, hf_config, remat, schedule, chunks, flags)
        params, state = _placed(step, opt, functional, flags)
        memory = step.memory(params, state)
        tokens = torch.zeros(batch * chunks, seq, dtype=torch.long, device="meta")
        data = {"tokens": tokens, "labels": tokens}
        layout = _pipeline_layout(step)
        measured = _measure(
            functional, step, params, state, data, config, model, preset, hf_config,
            sizes, remat, schedule, chunks, flags=flags,
        )  # fmt: skip
        if measured.comms is not None:
            comms = render_comms(measured.comms)
        else:
            comms = f"collectives: not counted on simulated ranks: {measured.error}"
        if sizes["ep"] > 1 and measured.comms is not None:
            comms += (
                "\nall_to_all on ep: dispatch and combine for uniform routing (each token's "
                "top-k experts drawn uniformly without replacement; a token goes once to each "
                "rank holding one of them: T * (1 - C(E - E/ep, k) / C(E, k)) tokens per rank, "
                "rounded), forward and backward"
            )
        plan = step.plan
        axes = " x ".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "one device"
        title = f"d9d plan: {described} on {ranks} simulated ranks: {axes}"
        stage = _stage_line(layout, schedule, chunks, batch, seq) if layout is not None else None
        # Under --pp the schedule holds more than its microbatches' activations (its
        # receive buffers; under shard_params the stages' gathered params): measured only.
        formula = (
            _activations(config, plan, sizes, batch, seq, remat, schedule, chunks)
            if isinstance(config, LlamaConfig | MoEConfig) and layout is None
            else None
        )
        first_matrix = next(
            p for p, e in plan.entries.items() if len(e.shape) == 2 and e.path in plan.held
        )
        explained = plan.explain(first_matrix)
    activations = formula if formula is not None else measured.kept
    total = memory.total + (activations or 0)
    lines = [
        title,
        render_plan(plan, title="", max_rows=max_rows),
        "memory on rank 0 (AdamW, "
        + ("bfloat16 params, float32 masters" if master_weights else "float32")
        + ("" if opt_state_dtype == "float32" else f", {opt_state_dtype} moments")
        + (", optimizer state on the host" if offload_opt_state else "")
        + ("):" if zero == 3 or sizes["fsdp"] == 1 else f", ZeRO-{zero} over fsdp):"),
        f"  params       {human(memory.params):>12}",
        f"  grads        {human(memory.grads):>12}",
        f"  optimizer    {human(memory.opt_state):>12}",
        *(_host_state_lines(memory.host_opt_state) if offload_opt_state else []),
        f"  activations  {human(activations) if activations is not None else 'n/a':>12}"
        + _activation_note(formula, measured, batch, seq, remat, sizes),
        f"  total        {human(total):>12}",
        *([stage] if stage is not None else []),
        comms,
        explained,
    ]
    return "\n".join(lines)


def _activation_note(
    formula: int | None,
    measured: DryRun,
    batch: int,
    seq: int,
    remat: str,
    sizes: dict[str, int],
) -> str:
    """Where the activation figure comes from, and what it counts."""
    shape = f"batch {batch} x seq {seq} per microbatch, remat {remat}"
    if formula is not None:
        return f"  (formula: {shape}; docs/plan.md)"
    if measured.kept is None:
        return f"  (not measured: the step did not run on meta: {measured.error})"
    if sizes["pp"] == 1:
        return f"  (measured on meta: {shape}; docs/plan.md)"
    held = "the schedule's buffers"
    if sizes["dp"] * sizes["fsdp"] > 1:
        held += " and the stages' gathered params"
    return f"  (measured on meta at rank 0's first backward, with {held}: {shape}; docs/plan.md)"


def _host_state_lines(host_bytes: int) -> list[str]:
    """The memory table's line of optimizer state kept in host memory (``--offload-opt-state``)."""
    note = "(optimizer state in host memory: not in the total)"
    return [f"  host state   {human(host_bytes):>12}  {note}"]


def _step(
    model: Model,
    sizes: dict[str, int],
    family: str,
    hf_config: Path | None,
    remat: str,
    schedule: str,
    microbatches: int,
    flags: _StepFlags = _StepFlags(),
    *,
    split: tuple[str, ...] | None = None,
) -> tuple[Any, Any]:
    """``d9d train``'s step and optimizer for the layout; ``split``: the block paths that
    begin pipeline stages 1, 2, ... (None: ``pipeline`` balances them, as ``d9d train``)."""
    config = TrainConfig(
        model=family,
        schedule=schedule,
        microbatches=microbatches,
        opt_state_dtype=flags.opt_state_dtype,
        zero=flags.zero,
        master_weights=flags.master_weights,
        offload_opt_state=flags.offload_opt_state,
        dtype="bfloat16" if flags.master_weights else "float32",
        **flags.fp8,
        **sizes,
    )
    opt = _optimizer(config)
    if hf_config is not None:
        fn = _logits_step(model, opt)
    elif family == "moe":
        from ...models.moe import make_train_step as make_moe_train_step

        fn = make_moe_train_step(model, opt, grad_norm=True)
    else:
        fn = make_train_step(model, opt, grad_norm=True)
    # d9d train runs one process untransformed; --offload-opt-state needs torchrun's one rank
    if math.prod(sizes.values()) == 1 and not flags.offload_opt_state:
        mesh = make_mesh("cpu", dp=1)
        step = with_fp8(config, mesh, shard_params(mesh, None, replicate_axis="dp")(fn))
    else:
        step = _parallel(config, fn)
    if split is not None:
        transforms = (
            replace(t, stages=split) if isinstance(t, Pipeline) else t for t in step.transforms
        )
        step = TransformedStep(step.fn, tuple(transforms))
    if remat != "none":
        step = remat_transform(remat, mesh=step.mesh)(step)
    return step, opt


def _placed(step: TransformedStep, opt: Any, model: Model, flags: _StepFlags) -> Any:
    """``step.place`` of ``model``'s params as ``d9d train`` stores them, and their state."""
    config = TrainConfig(master_weights=flags.master_weights)
    params = stored_params(config, model.params)
    return step.place(params, opt.init(params), model=model)


def _pipeline_layout(step: TransformedStep) -> PipelineLayout | None:
    """Rank 0's part of the pipeline, or None without ``--pp``."""
    return next((r.layout for r in step.runtimes if isinstance(r, PipelineRuntime)), None)


def _stage_line(
    layout: PipelineLayout, schedule: str, microbatches: int, batch: int, seq: int
) -> str:
    """Which stages rank 0 runs, and the schedule that moves its microbatches."""
    split = layout.split
    stages = []
    for s in layout.local_stages:
        start, stop = split.blocks[s]
        paths = split.block_paths[start:stop]
        held = [paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]}"]
        held = [*(split.before if s == 0 else ()), *held]
        held += split.after if s == split.count - 1 else ()
        stages.append(f"stage {s} ({', '.join(held)})")
    return (
        f"pipeline: rank 0 runs {' and '.join(stages)} of {split.count} stages on "
        f"{layout.size} ranks; schedule {schedule}, {microbatches} microbatches of {batch} x "
        f"{seq} tokens"
    )


def _base_blocks(config: LlamaConfig | MoEConfig | None) -> int:
    """Blocks before the run of identical ones: an MoE's dense blocks, and one."""
    return getattr(config, "n_dense_layers", 0) + 1


def _measure(
    functional: Model,
    step: TransformedStep,
    params: Any,
    state: Any,
    batch: dict[str, torch.Tensor],
    config: LlamaConfig | MoEConfig | None,
    model: str,
    preset: str,
    hf_config: Path | None,
    sizes: dict[str, int],
    remat: str,
    schedule: str,
    microbatches: int,
    *,
    flags: _StepFlags = _StepFlags(),
) -> DryRun:
    """The collectives of one step on rank 0 and the bytes its forward keeps: measured on
    the model itself, or, past a few blocks, on two small ones and extrapolated
    (``_per_block``)."""
    layout = _pipeline_layout(step)
    if config is None and not _uniform(functional):
        return dry_run(step, params, state, batch)
    n_layers = len(functional.structure.blocks) if config is None else config.n_layers
    if layout is None:
        if n_layers < _base_blocks(config) + 2:
            return dry_run(step, params, state, batch)
        return _per_block(
            config, model, preset, sizes, remat, schedule, microbatches, batch,
            hf_config=hf_config, n_layers=n_layers, known=step, flags=flags,
        )  # fmt: skip
    held = {s: layout.split.blocks[s][1] - layout.split.blocks[s][0] for s in layout.local_stages}
    # The small models have one block a stage, then grow one: an MoE's first block may be
    # dense (stage 0 holds it in both), but a second dense block would land in stage 1 and
    # be taken for what each added block costs, so such a model is measured whole.
    if sum(held.values()) < len(held) + 2 or _base_blocks(config) > 2:
        return dry_run(step, params, state, batch)
    return _per_block(
        config, model, preset, sizes, remat, schedule, microbatches, batch,
        hf_config=hf_config, pipeline=held, known=step, flags=flags,
    )  # fmt: skip


def _uniform(model: Model) -> bool:
    """Whether every block of a Hugging Face model is alike (its params' shapes, the
    config's ``layer_types``), so that a model of one or two stands for the rest."""
    structure = model.structure
    types = getattr(getattr(structure.module, "config", None), "layer_types", None)
    if types is not None and len(set(types)) > 1:
        return False
    shapes = {
        tuple((s.key[len(b.path) :], tuple(s.owner._parameters[s.name].shape)) for s in b.slots)
        for b in structure.blocks
    }
    return len(shapes) <= 1


def _per_block(
    config: LlamaConfig | MoEConfig | None,
    model: str,
    preset: str,
    sizes: dict[str, int],
    remat: str,
    schedule: str,
    microbatches: int,
    batch: dict[str, torch.Tensor],
    *,
    hf_config: Path | None = None,
    n_layers: int | None = None,
    pipeline: dict[int, int] | None = None,
    known: TransformedStep | None = None,
    flags: _StepFlags = _StepFlags(),
) -> DryRun:
    """The collectives of the whole model, and the bytes its forward keeps, from steps of
    ``base`` and ``base + 1`` blocks: every further block is identical, so moves and keeps
    what the one added block does. (Counting 2 blocks instead of 32 is what makes an 8B
    plan answer in seconds.)

    Under ``pipeline={rank 0's stage: blocks it holds}`` the small models have one block per
    stage, then one more in each of rank 0's stages in turn: each further block of a stage
    moves and keeps what the one added to it does (within its stage: fsdp, tp, cp
    collectives; its activations for the microbatches in flight in that stage at rank 0's
    first backward, which differ between the stages of an interleaved or zero-bubble
    schedule), and what crosses stages (an activation per microbatch) does not depend on
    how many blocks a stage holds.

    ``n_layers``: the model's blocks (default ``config.n_layers``). ``known``: a step built
    before these on the same mesh layout (``dry_run``). ``flags``: the optimizer's."""
    if pipeline is None:
        base = _base_blocks(config)
        total = n_layers if n_layers is not None else config.n_layers
        blocks, extra = base, {None: total - base}
    else:
        blocks, extra = sizes["pp"] * len(pipeline), {s: n - 1 for s, n in pipeline.items()}
    labels = group_labels(known) if known is not None else {}

    def measure(grown: int | None, n_blocks: int) -> DryRun:
        small, _, _ = build_model(model, preset, hf_config, n_layers=n_blocks)
        split = None
        if pipeline is not None:  # the blocks that begin stages 1, 2, ...: one a stage, two
            paths = [b.path for b in small.structure.blocks]  # in stage ``grown``
            split = tuple(paths[i + (grown is not None and i > grown)] for i in range(1, blocks))
        step, opt = _step(
            small, sizes, model, hf_config, remat, schedule, microbatches, flags, split=split
        )
        params, state = _placed(step, opt, small, flags)
        run = dry_run(step, params, state, batch, known=labels)
        labels.update(group_labels(step))
        return run

    low = measure(None, blocks)
    grown = {key: measure(key, blocks + 1) for key in extra}
    runs = [low, *grown.values()]
    kept = None
    if all(r.kept is not None for r in runs):
        kept = low.kept + sum(n * (grown[key].kept - low.kept) for key, n in extra.items())
    if any(r.comms is None for r in runs):
        return DryRun(None, kept, next(r.error for r in runs if r.error is not None))
    stats = CommStats()
    for name in ("count", "bytes"):
        base_figures, figures = getattr(low.comms, name), getattr(stats, name)
        for key, n in extra.items():
            added = getattr(grown[key].comms, name)
            for what in added:
                figures[what] += n * (added[what] - base_figures[what])
        for what in base_figures:
            figures[what] += base_figures[what]
    return DryRun(stats, kept)


def _logits_step(model: Model, opt: Any) -> Any:
    """``d9d train``'s step for a Hugging Face model, whose ``apply`` returns ``.logits``."""

    def loss_fn(params: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return losses.cross_entropy(model.apply(params, batch["tokens"]).logits, batch["labels"])

    def step(params: Any, opt_state: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, Any, Any]:
        from ... import optim

        loss, grads = value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, {"loss": loss}

    return step


def _activations(
    config: LlamaConfig | MoEConfig,
    plan: Any,
    sizes: dict[str, int],
    batch: int,
    seq: int,
    remat: str,
    schedule: str,
    microbatches: int,
) -> int | None:
    """Rank 0's activation bytes: its stage's blocks, microbatches in flight (1F1B's first
    stage holds ``pp``), the embedding, and the head where rank 0 holds it."""
    held = set(plan.held)
    blocks = len({p.split(".")[1] for p in held if p.startswith("layers.")})
    last = "norm.weight" in held
    layout = ActivationLayout(
        batch=batch,
        seq=seq,
        tp=sizes["tp"],
        cp=sizes["cp"],
        blocks=blocks,
        first="embed.weight" in held,
        last=last,
        microbatches=in_flight(schedule, microbatches, sizes["pp"], 0),
        remat=remat,
    )
    if isinstance(config, MoEConfig):
        return moe_activation_bytes(config, layout)
    return activation_bytes(config, layout)
