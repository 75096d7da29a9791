"""``d9d plan``: the sharding plan, per-rank memory and collectives of a layout, on a
simulated world, as text.

The model is built on the meta device and the ranks are simulated (``fake_world``); the step
and what it moves and keeps come from ``_measured_step``. Activations: the formula of
``_activations`` where it covers the model and layout (d9d's Llama and MoE, without
``--pp``), else the bytes the same dry run's forward kept for its backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...models import LlamaConfig, MoEConfig
from ...testing import fake_world
from ...transforms.pipeline import PipelineLayout
from .._options import check_fp8_flags, check_offload_flags
from ._activations import ActivationLayout, activation_bytes, in_flight, moe_activation_bytes
from ._checks import DEFAULT_PRESET
from ._checks import check_layout as _check
from ._dry_run import DryRun
from ._measured_step import StepFlags, measure, pipeline_layout, place_as_trained, plan_step
from ._models import build_model
from ._report import human, render_comms, render_plan

__all__ = ["show_plan"]


def show_plan(
    preset: str | None = None,
    *,
    model: str | None = None,
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
        preset: A ``LlamaConfig.preset`` (or, with ``model="moe"``, ``MoEConfig.preset``) name;
            None: ``DEFAULT_PRESET`` (8b), or the model of ``hf_config``.
        model: ``"llama"`` or ``"moe"``; None: ``"llama"``.
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
            without ``fp8``; ``offload_opt_state`` with ``master_weights``.

    Example:
        >>> print(show_plan("tiny", fsdp=2, seq=64, max_rows=4).splitlines()[0])
        d9d plan: llama tiny (125.25 K params) on 2 simulated ranks: fsdp=2
    """
    given = {"dp": dp, "fsdp": fsdp, "tp": tp, "cp": cp, "pp": pp, "ep": ep, "world": world}
    sizes = _check(model, remat, hf_config, preset=preset, **given)
    preset, model = preset or DEFAULT_PRESET, model or "llama"
    if zero != 3 and sizes["fsdp"] == 1:
        raise ValueError(f"--zero {zero} shards over --fsdp, which is 1 here; give it ranks")
    check_fp8_flags(fp8, fp8_include, fp8_exclude, fp8_gather)
    check_offload_flags(offload_opt_state, master_weights=master_weights)
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
    if microbatches is not None and pp == 1:
        raise ValueError(
            f"--microbatches {microbatches} splits the step over pipeline stages, and --pp is 1; "
            "give --pp ranks (gradient accumulation without a pipeline is d9d train's "
            "--grad-accum, which d9d plan does not model)"
        )
    if schedule != "1f1b" and pp == 1:
        raise ValueError(
            f"--schedule {schedule} orders the microbatches of pipeline stages, and --pp is 1; "
            "give --pp ranks, or drop --schedule"
        )
    chunks = microbatches or 2 * pp if pp > 1 else 1
    ranks = math.prod(sizes.values())
    with fake_world(ranks):
        functional, config, described = build_model(model, preset, hf_config)
        if seq is None:  # the model's longest sequence, at most 4096
            longest = getattr(config, "max_seq_len", None) or getattr(
                getattr(functional.module, "config", None), "max_position_embeddings", None
            )
            seq = min(4096, longest or 4096)
        flags = StepFlags(opt_state_dtype, zero, master_weights, fp8_options, offload_opt_state)
        step, opt = plan_step(functional, sizes, model, hf_config, remat, schedule, chunks, flags)
        params, state = place_as_trained(step, opt, functional, flags)
        memory = step.memory(params, state)
        tokens = torch.zeros(batch * chunks, seq, dtype=torch.long, device="meta")
        data = {"tokens": tokens, "labels": tokens}
        layout = pipeline_layout(step)
        measured = measure(
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
        # receive buffers; under shard_params the stages' gathered params), and
        # --master-weights computes the blocks in bfloat16 where the formula counts a float32
        # forward: measured only.
        formula = (
            _activations(config, plan, sizes, batch, seq, remat, schedule, chunks)
            if isinstance(config, LlamaConfig | MoEConfig) and layout is None and not master_weights
            else None
        )
        first_matrix = next(
            p for p, e in plan.entries.items() if len(e.shape) == 2 and e.path in plan.held
        )
        explained = plan.explain(first_matrix)
    activations = formula if formula is not None else measured.kept
    # Grads accumulated whole (a pipeline's) are held beside the microbatches' activations
    # and reduced to ``grads`` once they are gone: the peak holds the larger of the two.
    held_grads = max(memory.grads, memory.accumulated_grads)
    total = memory.params + held_grads + memory.opt_state + (activations or 0)
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
        *(_accumulated_lines(memory.accumulated_grads) if memory.accumulated_grads else []),
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


def _accumulated_lines(accumulated: int) -> list[str]:
    """The memory table's line of the whole grads a pipeline stage sums over its microbatches
    and reduces once a step (``step.memory``'s ``accumulated_grads``)."""
    note = "(whole, summed over microbatches, reduced once: in the total instead of grads)"
    return [f"  accumulated  {human(accumulated):>12}  {note}"]


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
