"""``d9d train``'s step for a layout, as ``d9d plan`` builds it on a simulated world, and
what one step of it moves and keeps, measured on meta tensors.

The step is ``d9d train``'s, under the transforms ``d9d train`` composes for the same flags.
Collectives come from running it once on meta tensors (``_dry_run``), under ``--pp`` the
pipeline schedule too. Past a few identical blocks, two small models are measured and the
rest extrapolated (:func:`measure`).
"""

from __future__ import annotations

import math
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
from ...transforms import remat as remat_transform
from ...transforms import shard_params
from ...transforms.pipeline import Pipeline, PipelineLayout, PipelineRuntime
from .._config import TrainConfig
from .._precision import stored_params
from .._train_step import _optimizer, _parallel, make_train_step, with_fp8
from ._dry_run import DryRun, dry_run, group_labels
from ._models import build_model

__all__ = ["StepFlags", "measure", "pipeline_layout", "place_as_trained", "plan_step"]


@dataclass(frozen=True)
class StepFlags:
    """``d9d train``'s flags that shape the step besides its layout: ``--opt-state-dtype``,
    ``--zero``, ``--master-weights``, ``--fp8`` with its options (``fp8``: those
    ``TrainConfig`` fields), and ``--offload-opt-state``."""

    opt_state_dtype: str = "float32"
    zero: int = 3
    master_weights: bool = False
    fp8: dict[str, Any] = field(default_factory=dict)
    offload_opt_state: bool = False


def plan_step(
    model: Model,
    sizes: dict[str, int],
    family: str,
    hf_config: Path | None,
    remat: str,
    schedule: str,
    microbatches: int,
    flags: StepFlags = StepFlags(),
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


def place_as_trained(step: TransformedStep, opt: Any, model: Model, flags: StepFlags) -> Any:
    """``step.place`` of ``model``'s params as ``d9d train`` stores them, and their state."""
    config = TrainConfig(master_weights=flags.master_weights)
    params = stored_params(config, model.params)
    return step.place(params, opt.init(params), model=model)


def pipeline_layout(step: TransformedStep) -> PipelineLayout | None:
    """Rank 0's part of the pipeline, or None without ``--pp``."""
    return next((r.layout for r in step.runtimes if isinstance(r, PipelineRuntime)), None)


def _base_blocks(config: LlamaConfig | MoEConfig | None) -> int:
    """Blocks before the run of identical ones: an MoE's dense blocks, and one."""
    return getattr(config, "n_dense_layers", 0) + 1


def measure(
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
    flags: StepFlags = StepFlags(),
) -> DryRun:
    """The collectives of one step on rank 0 and the bytes its forward keeps: measured on
    the model itself, or, past a few blocks, on two small ones and extrapolated
    (``_per_block``)."""
    layout = pipeline_layout(step)
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
    flags: StepFlags = StepFlags(),
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

    def measure_blocks(grown: int | None, n_blocks: int) -> DryRun:
        small, _, _ = build_model(model, preset, hf_config, n_layers=n_blocks)
        split = None
        if pipeline is not None:  # the blocks that begin stages 1, 2, ...: one a stage, two
            paths = [b.path for b in small.structure.blocks]  # in stage ``grown``
            split = tuple(paths[i + (grown is not None and i > grown)] for i in range(1, blocks))
        step, opt = plan_step(
            small, sizes, model, hf_config, remat, schedule, microbatches, flags, split=split
        )
        params, state = place_as_trained(step, opt, small, flags)
        run = dry_run(step, params, state, batch, known=labels)
        labels.update(group_labels(step))
        return run

    low = measure_blocks(None, blocks)
    grown = {key: measure_blocks(key, blocks + 1) for key in extra}
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
