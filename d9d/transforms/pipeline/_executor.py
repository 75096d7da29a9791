"""The microbatch executor that ``d9d.value_and_grad`` becomes under ``pipeline``.

Per step: the rank's stage params are gathered to their compute layout once
(``Differentiation.gather``: under ``shard_params`` one all-gather for all of them, none
under its ZeRO-1/2, which computes with the whole stored params) and become the parameters
of one ``nn.Module`` per local stage; a ``torch.distributed.pipelining`` schedule runs the
microbatches through ``PipelineStage``s wrapping those modules; the accumulated grads are
reduced to where the plan keeps them once (one reduce-scatter, or ZeRO-1's all-reduce). A stage module's forward calls the
user's loss function on its microbatch with the runtime's :class:`StageRun` set, and
``Model.apply`` runs only the stage's blocks (``_stage_apply.py``): it starts from the
received activation and stops after the stage's last block by raising :class:`StageDone`;
the last stage runs on to the loss.

The ``PipelineStage``s are built once per batch signature, with activation shapes from a
probe (``_stage_shapes``), and report their traffic and compute spans (``_stage_trace``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.tensor import DTensor

from ... import tree
from ...core._accumulated_dtype import accumulated_dtype
from ...core._autodiff import stack_aux
from ...core._comm_count import record_object_broadcast, recording_into
from ...core._context import count_tokens, record_step_tokens
from ...core._gather import distribute, local_like
from ...core._plan import Plan
from ...core._runtime import Differentiation
from ...errors import PlanError
from ._grad_sums import GradSums
from ._layout import SCHEDULES, PipelineLayout, StageDone, StageRun
from ._stage_shapes import LOSS_DTYPES, probe
from ._stage_trace import TracedStage, run_sampled, span
from ._stages import StageSplit
from ._wide_backward import grads_of_stored

__all__ = ["run_pipeline"]

_c10d = torch.ops._c10d_functional


class _StageParams(dict):
    """The params a stage's loss function sees; a missing path names the stage holding it."""

    def __init__(self, values: Mapping[str, torch.Tensor], split: StageSplit) -> None:
        super().__init__(values)
        self.split = split

    def __missing__(self, key: str) -> torch.Tensor:
        stages = self.split.stages_of(key)
        where = f"stage {stages[0]}" if stages else "no stage"
        raise PlanError(
            f"param {key!r} belongs to {where}, not to this rank's stages: under pipeline the "
            "loss function may use params only through model.apply"
        )


class _StageModule(nn.Module):
    """The module a ``PipelineStage`` runs: one stage of the user's loss function."""

    def __init__(self, stage: int, runner: list[_Runner]) -> None:
        super().__init__()
        self.stage = stage
        self.runner = runner  # a one-element box: the step in progress

    def forward(
        self, *inputs: torch.Tensor, mb: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # ``mb``: this microbatch's index, chunked by the schedule like any batch kwarg.
        return self.runner[0].run_stage(self.stage, inputs, int(mb.reshape(-1)[0]))

    def take_grads(self) -> None:
        """Move the grads a weight pass put in the params' ``.grad`` into their sums."""
        sums = self.runner[0].sums
        if sums is not None:
            sums.take(self.parameters())


@dataclass
class _Runtime:
    """Stage modules, ``PipelineStage``s and the schedule for one batch signature."""

    modules: dict[int, _StageModule]
    stages: list[pipelining.PipelineStage]
    schedule: Any
    shapes: dict[int, tuple[list[Any], list[Any]]]  # the probe's, per local stage
    box: list[Any]
    loss_dtype: torch.dtype
    device: torch.device


class _Runner:
    """One step's call of the loss function, stage by stage and microbatch by microbatch."""

    def __init__(
        self,
        job: Differentiation,
        params: _StageParams,
        chunks: list[Any],
        layout: PipelineLayout,
        sums: GradSums | None = None,
    ) -> None:
        self.fn, self.params, self.chunks, self.has_aux, self.layout = (
            job.fn,
            params,
            chunks,
            job.has_aux,
            layout,
        )
        self.sums = sums  # the weight grads' sums (None: a run that takes no grads)
        self.check_value = job.check_value
        self.aux: dict[int, Any] = {}
        self.weights: dict[int, torch.Tensor | None] = {}
        # {stage: its outputs' shapes and dtypes} the stages were built for (None: probing)
        self.built_for: dict[int, list[Any]] | None = None

    def run_stage(
        self, stage: int, inputs: tuple[torch.Tensor, ...], index: int, *, skip_blocks: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``stage``'s part of the loss function on microbatch ``index``, from ``inputs``
        (``skip_blocks``: with every block skipped, as :func:`_aux_on_meta` runs it)."""
        split = self.layout.split
        start, stop = split.blocks[stage]
        if skip_blocks:
            start = stop
        run = StageRun(stage, start, stop, stage == 0, stage == split.count - 1, inputs or None)
        args, kwargs = self.chunks[index]
        previous, self.layout.run = self.layout.run, run
        try:
            with count_tokens() as counts:
                out = self.fn(self.params, *args, **kwargs)
        except StageDone:
            self._check_built_for(stage, index, run.output)
            return run.output
        finally:
            run.done = True
            self.layout.run = previous
        if not run.applied or not run.last:
            raise PlanError(
                f"pipeline stage {stage}: the loss function returned without calling "
                "model.apply; under pipeline it must compute the loss from model.apply"
            )
        value, aux = out if self.has_aux else (out, None)
        self.check_value(value)
        self.aux[index] = tree.map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux)
        # The microbatch weighs by the valid tokens its loss counted (d9d.losses.token_mean),
        # applied before its backward: the step divides by the total once all have run.
        weight = torch.stack(counts).sum().to(value.dtype) if counts else None
        self.weights[index] = weight
        if weight is not None:
            value = value * weight
        if run.carried and run.input:  # leaves past the activation: an aux loss, loads
            value = _ZeroGradsFor.apply(value, *run.input[1:])
        # (1,), not 0-d: the schedule concatenates the last stage's outputs, and the
        # zero-bubble schedules detach them in place, which a view forbids.
        return value.reshape(1).clone()

    def _check_built_for(self, stage: int, index: int, output: Any) -> None:
        """Raise for an activation that differs from the one the stages were built for:
        the next stage would receive it into a buffer of the other shape."""
        if self.built_for is None:
            return
        values = output if isinstance(output, tuple) else (output,)
        got = [(tuple(v.shape), v.dtype) for v in values]
        if got != self.built_for[stage]:
            raise PlanError(
                f"pipeline stage {stage} passes on {_shapes(got)} for microbatch {index}, but "
                f"the stages were built for {_shapes(self.built_for[stage])}, by a probe of the "
                "first step of this batch signature (its tensors' shapes and dtypes, its Python "
                "ints, bools and strings): a value it does not see changed the activations (a "
                "0-d tensor, a value the loss function closes over); pass it in the batch as a "
                "Python int"
            )


def _shapes(metas: list[Any]) -> str:
    return ", ".join(f"{str(d).removeprefix('torch.')}{list(s)}" for s, d in metas)


class _ZeroGradsFor(torch.autograd.Function):
    """``value``, with a zero grad for each of ``received`` in backward.

    The last stage sends back a grad for every tensor it received, and torch 2.11's stage
    raises for one its loss did not use (the MoE loads: "has gradients None and is expecting
    to send gradients"), where 2.13 sends zeros. Zeros add nothing to the grads of those it
    used (the aux loss), and the leaves past the activation are small.
    """

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, *received: torch.Tensor) -> torch.Tensor:
        ctx.received = [(t.shape, t.dtype, t.device) for t in received]
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        zeros = (torch.zeros(s, dtype=d, device=device) for s, d, device in ctx.received)
        return grad, *zeros


def run_pipeline(
    job: Differentiation, plan: Plan, layout: PipelineLayout
) -> tuple[torch.Tensor, Any, list[torch.Tensor], torch.Tensor | None]:
    """``(mean loss, aux, grads, weight)`` of ``job`` over the layout's microbatches, run
    stage by stage under its schedule; grads laid out like the stored params, the loss and
    grads means over ``weight`` valid tokens (None: the loss counted none), on every rank."""
    chunks = job.split(layout.microbatches)
    paths = [path for path, _ in job.pairs]
    # Copies in the accumulated dtype where the step holds its grads wide (fault_tolerant's
    # float32 reduction over replica groups): the grads come back in it, unrounded.
    stored = job.leaves()
    with torch.enable_grad():
        gathered = job.gather(paths, stored)
    weights = {p: nn.Parameter(gathered[p].detach()) for p in paths}
    sums = GradSums(weights, {p: accumulated_dtype(plan.entries[p]) for p in paths})
    runner = _Runner(job, _StageParams(weights, layout.split), chunks, layout, sums)
    runtime = _runtime(runner, layout, chunks)
    runtime.box[0] = runner
    runner.built_for = {stage: leaving for stage, (_, leaving) in runtime.shapes.items()}
    for stage, module in runtime.modules.items():
        module._parameters.clear()
        for i, key in enumerate(layout.split.keys[stage]):
            module._parameters[f"p{i}"] = weights[key]
    last = layout.owner(layout.split.count - 1) == layout.rank
    count = len(chunks)
    losses: list[torch.Tensor] = []
    extra = {"target": torch.arange(count), "losses": losses} if last else {}
    sampled = _sampled(job, layout, runtime.device)
    try:
        with torch.enable_grad(), span("schedule", -1, count):
            if sampled:
                zero_bubble = SCHEDULES[layout.schedule].zero_bubble
                run_sampled(runtime.schedule, runtime.shapes, layout, count, zero_bubble, **extra)
                # The schedule hands the last stage's losses over at its end, which a
                # sampled run does not reach: stand-ins of their shape (meta has no values).
                losses[:] = [torch.zeros((), dtype=runtime.loss_dtype, device="meta")] * (
                    count if last else 0
                )
            else:
                runtime.schedule.step(mb=torch.arange(count), **extra)
    finally:
        sums.close()
        runtime.box[0] = None
        for stage in runtime.stages:
            # torch clears a stage's per-microbatch state when its next step starts: the grads
            # zero-bubble's input pass leaves on the received activations would be held
            # through the reduction, the update and until the next step.
            stage.clear_runtime_states()
        for module in runtime.modules.values():  # the cached stages must not keep them alive
            module._parameters.clear()
    value, total, weight = _loss_on_every_rank(losses, runner, runtime, last, layout)
    # Divided in place: a second whole copy of the stage's grads would be held beside them
    # (step.memory's accumulated_grads counts one).
    compute_grads = []
    for p in paths:
        summed = sums.grad(weights[p])
        compute_grads.append(
            summed.div_(total) if summed is not None else torch.zeros_like(weights[p])
        )
    entries = [plan.entries[p] for p in paths]
    grads = grads_of_stored(entries, [gathered[p] for p in paths], compute_grads, stored)
    grads = [_sum_tied(g, p, layout) for g, p in zip(grads, paths, strict=True)]
    aux = None
    if job.has_aux and sampled:
        aux = _aux_on_meta(job, plan, layout, chunks, weights)
        record_object_broadcast(aux, layout.axis)  # what _aux_on_every_rank would send
    elif job.has_aux:
        aux = _aux_on_every_rank(runner, count, layout)
    return value, aux, grads, weight


def _sampled(job: Differentiation, layout: PipelineLayout, device: torch.device) -> bool:
    """Whether this rank's schedule is counted from one microbatch of each stage action
    (``_stage_trace.run_sampled``): a dry run on meta of a loss with aux outputs, under a
    schedule whose microbatches all run the same actions (``ScheduleKind.uniform``). A rank
    without the last stage would receive the aux outputs from it as a Python object
    (``_aux_on_every_rank``), which no meta tensor carries; a sampled rank makes their
    structure itself (:func:`_aux_on_meta`). And the whole schedule on meta is slow: on
    DeepSeek-V3's rank 0 under pp=8 (10 blocks, 16 microbatches of 1F1B) it took 12.4 s
    (profiled) of a 17 s plan, up to the first backward 1.7 s; under zbv, where rank 0
    holds the last stage too, the plan took 13.3 s CPU whole, 9.4 s sampled (docs/plan.md)."""
    if device.type != "meta" or not job.has_aux:
        return False
    last = layout.owner(layout.split.count - 1) == layout.rank
    return SCHEDULES[layout.schedule].uniform or not last


def _aux_on_meta(
    job: Differentiation,
    plan: Plan,
    layout: PipelineLayout,
    chunks: list[Any],
    weights: Mapping[str, torch.Tensor],
) -> Any:
    """The aux outputs a sampled dry run (:func:`_sampled`) would receive: the last stage's
    loss function run on microbatch 0 with every block skipped (the blocks keep their
    outputs' structure: a carried state, such as the MoE's loads, keeps its shapes) and
    its modules after the blocks holding meta params, uncounted, stacked as for
    ``count`` microbatches."""
    last = layout.split.count - 1
    params = dict(weights)
    for key in layout.split.keys[last]:
        if key not in params:
            entry = plan.entries[key]
            full = torch.empty(entry.shape, dtype=entry.compute_dtype or entry.dtype, device="meta")
            params[key] = distribute(full, plan.mesh, entry.compute).to_local()
    runner = _Runner(job, _StageParams(params, layout.split), chunks, layout)
    with torch.no_grad(), recording_into(None):
        runner.run_stage(last, (), 0, skip_blocks=True)
    count = len(chunks)
    return stack_aux([runner.aux[0]] * count, [runner.weights[0]] * count)


def _sum_tied(grad: torch.Tensor, path: str, layout: PipelineLayout) -> torch.Tensor:
    """A tied param's grad summed over the two ranks holding it."""
    if layout.ranks_holding(path) < 2:
        return grad
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    total = _c10d.wait_tensor(_c10d.all_reduce(local, "sum", layout.tie_group.group_name))
    return local_like(total, grad) if isinstance(grad, DTensor) else total


def _loss_on_every_rank(
    losses: list[torch.Tensor],
    runner: _Runner,
    runtime: _Runtime,
    last: bool,
    layout: PipelineLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(loss, total weight, token count)`` on every pipeline rank (one all-reduce): the
    last stage's microbatch losses, each weighed by its valid-token count (or all alike
    when the loss counts none), the total the summed grads are divided by, and the valid
    tokens counted in float64 (None when the loss counts none). A counted total is also the
    step's tokens on every rank (``record_step_tokens``), as the last stage counted them."""
    dtype = runtime.loss_dtype
    packed = torch.zeros(4, dtype=torch.float64, device=runtime.device)
    if last:
        weights = list(runner.weights.values())
        packed[0] = torch.stack([loss.detach() for loss in losses]).sum().to(torch.float64)
        packed[1] = LOSS_DTYPES.index(dtype)
        packed[2] = len(losses) if weights[0] is None else torch.stack(weights).sum()
        packed[3] = weights[0] is not None
    packed = _c10d.wait_tensor(_c10d.all_reduce(packed, "sum", layout.group.group_name))
    total = packed[2].clamp(min=1)
    counted = packed.is_meta or bool(packed[3])  # on meta: as a loss that counts
    if not packed.is_meta:  # a dry run on meta has no values: it keeps its own dtype
        dtype = LOSS_DTYPES[int(packed[1])]
        if packed[3]:
            record_step_tokens([packed[2].to(torch.int64)])
    return (packed[0] / total).to(dtype), total, packed[2] if counted else None


def _aux_on_every_rank(runner: _Runner, count: int, layout: PipelineLayout) -> Any:
    """The loss function's aux outputs, which only the last stage computes, on every rank:
    sent as a Python object, whose structure and shapes no other rank knows beforehand."""
    box = [None]
    last = layout.owner(layout.split.count - 1)
    if layout.rank == last:
        box[0] = stack_aux(
            [runner.aux[i] for i in range(count)], [runner.weights[i] for i in range(count)]
        )
    dist.broadcast_object_list(
        box, src=dist.get_global_rank(layout.group, last), group=layout.group
    )
    return box[0]


def _signature(chunk: Any) -> tuple:
    """What the stages' activation shapes depend on: each tensor's shape and dtype, and each
    Python int, bool, str or None itself (a length the loss function cuts the tokens to, a
    mode); other values by their type. Keyed by types alone, a second step whose int halved
    the sequence ran on the stages built for the first: rank 1 received the old shape and
    crashed in its first block."""
    leaves, spec = tree.flatten(chunk)
    shapes = tuple(
        (tuple(x.shape), x.dtype)
        if isinstance(x, torch.Tensor)
        else (type(x), x)
        if x is None or isinstance(x, int | str)
        else type(x)
        for x in leaves
    )
    return str(spec), shapes


_KEPT_BUILDS = 8  # stage builds kept per layout (by batch signature)


def _runtime(runner: _Runner, layout: PipelineLayout, chunks: list[Any]) -> _Runtime:
    key = (_signature(chunks[0]), len(chunks), getattr(runner.fn, "__code__", runner.fn))
    runtime = layout.cache.get(key)
    if runtime is None:
        if len(layout.cache) > _KEPT_BUILDS:
            warnings.warn(
                f"pipeline built its stages for more than {_KEPT_BUILDS} batch signatures "
                "(the batch's tensor shapes and dtypes, and its Python ints, bools and "
                "strings, by value), and builds them again for each new one (a probe of every "
                "stage): a value of the batch that changes every step but not the activations "
                "(a step counter) belongs in it as a 0-d tensor",
                stacklevel=2,
            )
            layout.cache.clear()
        runtime = _build(runner, layout, len(chunks))
        layout.cache[key] = runtime
    return runtime


def _device(layout: PipelineLayout, params: Mapping[str, torch.Tensor]) -> torch.device:
    """The stages' device: the mesh's, or meta for a step run on meta params (a dry run,
    as ``d9d plan`` counts collectives)."""
    if any(p.is_meta for p in params.values()):
        return torch.device("meta")
    kind = layout.stage_mesh.device_type
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _build(runner: _Runner, layout: PipelineLayout, count: int) -> _Runtime:
    """Probe activation shapes, then build the stages and the schedule."""
    box: list[Any] = [runner]
    modules = {s: _StageModule(s, box) for s in layout.local_stages}
    device = _device(layout, runner.params)
    # Once per batch shape, not a step's traffic: the collectives of the stages' forward
    # (tp, cp, ep, the loss's token count) go uncounted, as its shape headers do.
    with recording_into(None):
        shapes = probe(runner, layout, device)
    stages = []
    for s in layout.local_stages:
        entering, leaving = shapes[s]
        outputs = tuple(_example(shape, dtype, device) for shape, dtype in leaving)
        stage = TracedStage(
            modules[s],
            s,
            layout.split.count,
            device,
            input_args=tuple(_example(shape, dtype, device) for shape, dtype in entering),
            output_args=outputs[0] if len(outputs) == 1 else outputs,
            group=layout.group,
        )
        stage.axis_name = layout.axis
        stage.after_weight_pass = modules[s].take_grads
        stages.append(stage)
    kind = SCHEDULES[layout.schedule]
    schedule_type = getattr(pipelining.schedules, kind.name)
    try:
        schedule = schedule_type(
            stages if kind.multi else stages[0],
            n_microbatches=count,
            loss_fn=_stage_loss,
            scale_grads=False,
        )
    except (ValueError, AssertionError) as error:
        raise PlanError(
            f"pipeline(schedule={layout.schedule!r}) cannot run {count} microbatches on "
            f"{layout.size} ranks x {len(layout.local_stages)} stages: {error}"
        ) from error
    last = layout.split.count - 1
    loss_dtype = shapes[last][1][0][1] if last in shapes else torch.float32
    return _Runtime(modules, stages, schedule, shapes, box, loss_dtype, device)


def _example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An example activation for ``PipelineStage``: float ones carry grads back."""
    return torch.empty(shape, dtype=dtype, device=device, requires_grad=dtype.is_floating_point)


def _stage_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss: the last stage's output already is the microbatch's loss."""
    del target
    return output.sum()  # of its one element; not a view (zero-bubble detaches it in place)
