"""``pipeline``: the model's blocks cut into stages over a mesh axis, run by a schedule.

Each rank of the ``pp`` axis holds, updates and checkpoints only its stages' params (and their
optimizer state). The step itself is unchanged: ``d9d.value_and_grad`` of the loss becomes a
microbatch executor (``_executor.py`` beside this file) driven by a ``torch.distributed.pipelining``
schedule, and returns the loss of the whole batch on every rank and the grads of this
rank's params.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from ...core._mesh_hash import pin_hash
from ...core._param_plan import ParamPlan
from ...core._phase import Phase
from ...core._plan import Plan
from ...core._transform import Transform
from ...errors import PlanError
from ._layout import SCHEDULES, PipelineLayout, stage_owner
from ._runtime import PipelineRuntime
from ._stages import StageSplit, split_stages

if TYPE_CHECKING:
    from ...core._model import Model

__all__ = ["Pipeline", "pipeline"]


@dataclass(frozen=True)
class Pipeline(Transform):
    """The ``pipeline`` transform; build it with :func:`pipeline`."""

    name: ClassVar[str] = "pipeline"
    phase: ClassVar[Phase] = Phase.STAGES
    mesh: DeviceMesh
    axis: str = "pp"
    stages: tuple[str, ...] | None = None
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    _stage_mesh: DeviceMesh = field(init=False, repr=False, compare=False)
    _tie_group: Any = field(init=False, repr=False, compare=False)
    _splits: dict[int, StageSplit] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = self._axis_index(self.axis, "axis")
        if self.schedule not in SCHEDULES:
            raise PlanError(
                f"pipeline(schedule={self.schedule!r}) is not a schedule; use one of "
                f"{sorted(SCHEDULES)}"
            )
        for name, value in (
            ("microbatches", self.microbatches),
            ("virtual_stages", self.virtual_stages),
        ):
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"pipeline needs {name} >= 1, got {name}={value!r}")
        wanted = SCHEDULES[self.schedule].virtual_stages
        if wanted is not None and self.virtual_stages != wanted:
            raise PlanError(
                f"pipeline(schedule={self.schedule!r}) runs {wanted} stage(s) per rank, got "
                f"virtual_stages={self.virtual_stages}; use schedule='interleaved_1f1b' or "
                "'interleaved_zb' for other counts"
            )
        # Process groups are made here, while every rank builds the same transform.
        object.__setattr__(self, "_stage_mesh", _stage_mesh(self.mesh, self.axis))
        object.__setattr__(self, "_tie_group", self._pair_group(index))
        object.__setattr__(self, "_splits", {})

    def __str__(self) -> str:
        return (
            f"pipeline(axis={self.axis!r}, schedule={self.schedule!r}, "
            f"microbatches={self.microbatches}, virtual_stages={self.virtual_stages})"
        )

    def claimed_axes(self) -> tuple[str, ...]:
        return (self.axis,)

    def rewrite(self, entry: ParamPlan) -> ParamPlan:
        # Whole on its stage's ranks; the plan drops the axis once it knows the stages.
        return entry

    def _split(self, model: Model | None) -> StageSplit:
        if model is None:
            raise PlanError(
                f"{self} cuts the model into stages and needs it: call "
                "step.place(params, opt_state, model=model)"
            )
        found = self._splits.get(id(model))
        if found is None:
            size = self.mesh.shape[self._axis_index(self.axis, "axis")]
            found = split_stages(model, size * self.virtual_stages, self.stages)
            _check_shared(found, size, SCHEDULES[self.schedule].style)
            self._splits.clear()
            self._splits[id(model)] = found
        return found

    def lay_out(self, plan: Plan, model: Model | None) -> Plan:
        """The plan on the stage mesh (this axis dropped), each param with its stages, and
        this rank's stages' params held."""
        layout = self._layout(model)
        i = self._axis_index(self.axis, "axis")
        entries = {p: _onto_stage(e, i, layout) for p, e in plan.entries.items()}
        return Plan(
            layout.stage_mesh,
            entries,
            held=layout.held,
            stage_group=layout.group.group_name,
            notes=(
                *plan.notes,
                f"one of {layout.split.count} stages over {self.axis}={layout.size} "
                f"({self.schedule})",
            ),
        )

    def runtime(self, plan: Plan, model: Model | None) -> PipelineRuntime:
        return PipelineRuntime(self._layout(model), plan)

    def _layout(self, model: Model | None) -> PipelineLayout:
        split = self._split(model)
        index = self._axis_index(self.axis, "axis")
        size = self.mesh.shape[index]
        rank = self._coordinate(self.axis)
        style = SCHEDULES[self.schedule].style
        return PipelineLayout(
            axis=self.axis,
            index=index,
            group=self.mesh.get_group(self.axis),
            rank=rank,
            size=size,
            split=split,
            schedule=self.schedule,
            microbatches=self.microbatches,
            local_stages=tuple(
                s for s in range(split.count) if stage_owner(s, size, style) == rank
            ),
            stage_mesh=self._stage_mesh,
            tie_group=self._tie_group,
        )

    def _pair_group(self, index: int) -> Any:
        """The group of this rank and its peer holding the other end of a tied param
        (first and last stage), when the two are on different ranks."""
        size = self.mesh.shape[index]
        style = SCHEDULES[self.schedule].style
        count = size * self.virtual_stages
        first, last = stage_owner(0, size, style), stage_owner(count - 1, size, style)
        if first == last:
            return None
        lines = self.mesh.mesh.movedim(index, 0).reshape(size, -1)
        mine = None
        for column in range(lines.shape[1]):
            ranks = [int(lines[first, column]), int(lines[last, column])]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        return mine


def _check_shared(split: StageSplit, size: int, style: str) -> None:
    """Raise for a param held by stages on pipeline ranks other than the first and last
    stage's: its grads are summed only over those two (a head tied to the embedding)."""
    ends = {stage_owner(0, size, style), stage_owner(split.count - 1, size, style)}
    for key in dict.fromkeys(k for keys in split.keys for k in keys):
        stages = split.stages_of(key)
        ranks = {stage_owner(s, size, style) for s in stages}
        if len(ranks) > 1 and ranks != ends:
            raise PlanError(
                f"param {key!r} is shared by stages {list(stages)}, on pipeline ranks "
                f"{sorted(ranks)}, but pipeline sums a shared param's grads only between the "
                f"first and last stage's ranks {sorted(ends)} (a head tied to the "
                "embedding); put the blocks sharing it on one rank (stages=[...]) or on those "
                "two, or untie it"
            )


def _onto_stage(entry: ParamPlan, index: int, layout: PipelineLayout) -> ParamPlan:
    """``entry`` laid out on the stage mesh (mesh axis ``index`` dropped), with its stages."""

    def drop(placements: tuple) -> tuple:
        return (*placements[:index], *placements[index + 1 :]) or (Replicate(),)

    def drop_kept(placements: tuple | None) -> tuple | None:  # None: as stored
        return None if placements is None else drop(placements)

    stages = layout.split.stages_of(entry.path)
    where = ", ".join(str(s) for s in stages)
    return replace(
        entry,
        storage=drop(entry.storage),
        compute=drop(entry.compute),
        grad=drop(entry.grad),
        grad_storage=drop_kept(entry.grad_storage),
        state=drop_kept(entry.state),
        stage_copies=layout.ranks_holding(entry.path),
        reasons=(
            *entry.reasons,
            f"pipeline: held by stage {where} of {layout.split.count}"
            + (", grads summed over them (tied)" if len(stages) > 1 else ""),
        ),
    ).annotate(Stages(stages))


@dataclass(frozen=True)
class Stages:
    """A param's annotation under ``pipeline``: the stages that hold it (the plan's
    ``stage`` column)."""

    column: ClassVar[str] = "stage"
    indices: tuple[int, ...]

    def cell(self) -> str:
        """The table's cell: the stages, comma-separated."""
        return ",".join(str(s) for s in self.indices)


def stages_of(entry: ParamPlan) -> tuple[int, ...]:
    """The stages holding ``entry``'s param (empty without ``pipeline``)."""
    found = entry.annotation(Stages)
    return () if found is None else found.indices


def _stage_mesh(mesh: DeviceMesh, axis: str) -> DeviceMesh:
    """The mesh a stage's params live on: ``mesh`` without ``axis`` (a one-rank mesh when
    ``axis`` is the only one)."""
    names = tuple(mesh.mesh_dim_names or ())
    rest = tuple(n for n in names if n != axis)
    if rest:
        return pin_hash(mesh[rest])
    alone = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, 1), mesh_dim_names=(axis, "stage"))
    pin_hash(alone)  # the stage mesh pickles its root with it
    return pin_hash(alone["stage"])


def pipeline(
    mesh: DeviceMesh,
    axis: str = "pp",
    stages: Sequence[str] | None = None,
    *,
    schedule: str = "1f1b",
    microbatches: int = 1,
    virtual_stages: int = 1,
) -> Pipeline:
    """Cut the model into stages over a mesh axis and run the loss with a pipeline schedule.

    ``model.apply`` is cut between blocks (the children of the model's ``nn.ModuleList``):
    at ``stages``, the paths of the blocks that begin stages 1, 2, ..., or balanced by
    per-block FLOPs. Each ``axis`` rank holds only its stages' params; ``step.place`` keeps
    only those (and their optimizer state). Inside the step, ``d9d.value_and_grad(loss_fn)``
    splits the batch into ``microbatches`` and runs ``loss_fn`` stage by stage under
    ``schedule``: the first stage from the batch to its last block, the next from the
    activation it receives (every tensor of a block's state, when blocks take and return a
    tuple, as the MoE decoder's do), the last to the loss. It returns the mean loss over the
    batch on every rank and the grads of this rank's params (gathered once per step under
    ``shard_params``, reduced once). A param tied between the first and last stage (a head
    sharing the embedding) is held by both and its grads summed.
    ``d9d.optim.clip_by_global_norm`` clips by the norm over all stages.

    The loss function may use params only through ``model.apply`` (once per call), and
    everything it returns besides the loss comes from the last stage.

    Args:
        mesh: The mesh, from :func:`d9d.make_mesh`.
        axis: The mesh axis of the stages. Default ``"pp"``.
        stages: Block paths where stages 1, 2, ... begin, or None to balance.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"interleaved_zb"``,
            ``"zbv"`` (zero bubble, two stages per rank in a V) or ``"dualpipev"``
            (DeepSeek's DualPipe on that V).
        microbatches: Microbatches per step; must divide the per-rank batch.
        virtual_stages: Stages per rank (interleaved schedules; 2 for ``"zbv"`` and
            ``"dualpipev"``).

    Returns:
        The transform: decorate a step with it, and pass ``model=`` to ``step.place``.

    Raises:
        PlanError: ``axis`` is not on the mesh, an unknown schedule, or ``virtual_stages``
            that the schedule does not run.

    Example:
        >>> import d9d
        >>> from d9d.models import Llama, LlamaConfig
        >>> from d9d.testing import run_on_ranks
        >>> def rank_fn():
        ...     mesh = d9d.make_mesh("cpu", pp=2)
        ...     model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=2)))
        ...     step = pipeline(mesh, microbatches=2)(lambda p, s, b: (p, s, {}))
        ...     params, _ = step.place(model.params, (), model=model)
        ...     return sorted(params)[:2]
        >>> run_on_ranks(rank_fn, 2, method="fork")
        [['embed.weight', 'layers.0.attn.wk.weight'], ['head.weight', 'layers.1.attn.wk.weight']]
    """
    return Pipeline(
        mesh,
        axis,
        tuple(stages) if stages is not None else None,
        schedule,
        microbatches,
        virtual_stages,
    )
