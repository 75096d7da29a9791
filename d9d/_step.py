"""Transforms and the transformed step: ``place``, ``plan``, ``comms``, ``memory``, call."""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

from . import tree
from ._activations import ActivationLayout, check_modules
from ._active import activate
from ._batch_check import BatchSignature, batch_signature, check_batch
from ._comms import CollectiveCounter, CommStats
from ._module import Axes, Model
from ._pipeline_run import PipelineLayout
from ._plan import ParamPlan, Plan
from ._sequence_split import SequenceSplit
from .errors import IndivisibleError, ParamShapeError, PlanError

__all__ = ["Memory", "Transform", "TransformedStep"]


class Transform(abc.ABC):
    """A rewrite of a step's param layout (and, for some, of the step) on a mesh.

    Subclasses are frozen dataclasses with a ``mesh`` field; ``order`` fixes where they apply
    among the others, whatever the decorator order.
    """

    order: ClassVar[int]
    mesh: DeviceMesh

    @abc.abstractmethod
    def claimed_axes(self) -> tuple[str, ...]:
        """The mesh axes this transform owns."""

    def data_axes(self) -> tuple[str, ...]:
        """The mesh axes over which ranks see different batches (default none)."""
        return ()

    def token_axes(self) -> tuple[str, ...]:
        """The mesh axes over which ranks hold different tokens of the global batch (default:
        the data axes): losses and grads are means over their ranks' tokens."""
        return self.data_axes()

    def keeps_gathered_params(self) -> bool:
        """Whether gathered params stay alive from the forward to the backward (default no)."""
        return False

    def microbatches_per_step(self) -> int:
        """Microbatches ``value_and_grad`` splits each batch into (default 1)."""
        return 1

    def activation_layout(self) -> ActivationLayout | None:
        """How activations are laid out between modules (tensor parallelism; default None)."""
        return None

    def sequence_split(self) -> SequenceSplit | None:
        """How each rank's sequences are split over ranks (context parallelism; default None)."""
        return None

    def pipeline_layout(self, model: Model | None) -> PipelineLayout | None:
        """How ``model`` is cut into pipeline stages (default None: not cut)."""
        return None

    @abc.abstractmethod
    def rewrite(self, entry: ParamPlan) -> ParamPlan:
        """The param's plan after this transform."""

    def __call__(self, step: Callable[..., Any]) -> TransformedStep:
        if isinstance(step, TransformedStep):
            return step.with_transform(self)
        return TransformedStep(step, (self,))

    def _axis_index(self, axis: str, option: str) -> int:
        names = tuple(self.mesh.mesh_dim_names or ())
        if axis not in names:
            raise PlanError(
                f"{type(self).__name__}({option}={axis!r}) names an axis the mesh does not "
                f"have: mesh axes are {names}; build it with d9d.make_mesh({axis}=N, ...)"
            )
        return names.index(axis)


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds for params, grads and optimizer state."""

    params: int
    grads: int
    opt_state: int

    @property
    def total(self) -> int:
        """Sum of the three."""
        return self.params + self.grads + self.opt_state

    def __str__(self) -> str:
        return (
            f"params {self.params:,} B, grads {self.grads:,} B, optimizer state "
            f"{self.opt_state:,} B: {self.total:,} B per rank"
        )


class TransformedStep:
    """A step rewritten by transforms; call it like the step it wraps.

    ``place(params, opt_state)`` lays trees out on the mesh and builds ``plan``;
    ``comms(...)`` and ``memory(...)`` inspect one step.
    """

    def __init__(self, fn: Callable[..., Any], transforms: tuple[Transform, ...]) -> None:
        self.fn = fn
        self.transforms = tuple(sorted(transforms, key=lambda t: t.order))
        self.mesh = _one_mesh(self.transforms)
        _check_claims(self.transforms)
        self._plan: Plan | None = None
        self._checked_batch: BatchSignature | None = None
        functools.update_wrapper(self, fn, updated=())

    def with_transform(self, transform: Transform) -> TransformedStep:
        """This step with one more transform."""
        return TransformedStep(self.fn, (*self.transforms, transform))

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Mesh axes over which ranks see different batches."""
        return tuple(a for t in self.transforms for a in t.data_axes())

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Mesh axes over which ranks hold different tokens (data axes and the cp axis)."""
        return tuple(a for t in self.transforms for a in t.token_axes())

    def batch_shard(self) -> tuple[int, int]:
        """``(index, count)`` of this rank's batch among the data-parallel ranks.

        Ranks that differ only on other axes (``tp``, ``cp``, ``pp``) get the same index; feed
        rank ``index`` of ``count`` (``TokenLoader(dp_rank=index, dp_size=count)``).
        """
        index, count = 0, 1
        names = tuple(self.mesh.mesh_dim_names or ())
        coordinate = self.mesh.get_coordinate() or [0] * self.mesh.ndim
        for name, size, at in zip(names, self.mesh.shape, coordinate, strict=True):
            if name in self.data_axes:
                index, count = index * size + at, count * size
        return index, count

    def shard_batch(self, batch: Any) -> Any:
        """This rank's slice (along dim 0) of a global ``batch``, per :meth:`batch_shard`.

        Raises:
            IndivisibleError: A leaf's batch size does not divide by the data-parallel ranks.
        """
        index, count = self.batch_shard()

        def take(path: str, leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0:
                return leaf
            if leaf.shape[0] % count:
                raise IndivisibleError(
                    f"batch leaf {path!r} holds {leaf.shape[0]} examples, which do not split "
                    f"over {count} data-parallel ranks ({self.data_axes}); use a global batch "
                    f"that is a multiple of {count}"
                )
            size = leaf.shape[0] // count
            return leaf[index * size : (index + 1) * size]

        return tree.map_with_path(take, batch)

    @property
    def plan(self) -> Plan:
        """The plan built by the last ``place``."""
        if self._plan is None:
            raise PlanError("the step has no plan yet: call step.place(params, opt_state) first")
        return self._plan

    def make_plan(
        self,
        params: Mapping[str, Any],
        axes: Mapping[str, Axes] | None = None,
        model: Model | None = None,
    ) -> Plan:
        """The plan for ``params`` (tensors or meta tensors; only shapes and dtypes are read);
        ``model`` is needed by ``pipeline``, which cuts it into stages."""
        _check_all_axes_used(self.transforms, self.mesh)
        entries = {}
        replicated = (Replicate(),) * self.mesh.ndim
        for path, leaf in params.items():
            entry = ParamPlan(
                path=path,
                shape=tuple(leaf.shape),
                dtype=leaf.dtype,
                axes=(axes or {}).get(path),
                storage=replicated,
                compute=replicated,
                grad=replicated,
            )
            for transform in self.transforms:
                entry = transform.rewrite(entry)
            entries[path] = entry
        keep = any(t.keeps_gathered_params() for t in self.transforms)
        microbatches = max((t.microbatches_per_step() for t in self.transforms), default=1)
        layouts = [t.activation_layout() for t in self.transforms]
        activations = next((a for a in layouts if a is not None), None)
        pipeline = next(
            (p for p in (t.pipeline_layout(model) for t in self.transforms) if p is not None), None
        )
        mesh = self.mesh
        if pipeline is not None:
            if microbatches > 1:
                raise PlanError(
                    "pipeline splits each batch into its own microbatches; drop "
                    f"shard_params(microbatches={microbatches}) and set pipeline(microbatches=...)"
                )
            mesh = pipeline.stage_mesh
            entries = {p: _onto_stage_mesh(e, pipeline) for p, e in entries.items()}
            if activations is not None:
                activations = replace(
                    activations, index=activations.index - (activations.index > pipeline.index)
                )
        if activations is not None and model is not None:
            check_modules(model, entries, activations)
        names = tuple(mesh.mesh_dim_names or ())
        token_groups = tuple(
            (mesh.get_group(a).group_name, mesh.shape[names.index(a)])
            for a in self.token_axes
            if mesh.shape[names.index(a)] > 1
        )
        return Plan(
            mesh,
            entries,
            self.transforms,
            reshard_after_forward=not keep,
            microbatches=microbatches,
            activations=activations,
            sequence_split=next(
                (s for s in (t.sequence_split() for t in self.transforms) if s is not None), None
            ),
            pipeline=pipeline,
            token_groups=token_groups,
        )

    def place(
        self,
        params: Mapping[str, torch.Tensor],
        opt_state: Any,
        *,
        axes: Mapping[str, Axes] | None = None,
        model: Model | None = None,
    ) -> tuple[dict[str, DTensor], Any]:
        """Lay ``params`` and ``opt_state`` out on the mesh as DTensors, per the plan.

        Every rank must pass the same full tensors (e.g. from the same seed); each keeps its
        own shard, with no communication. Optimizer-state leaves shaped like a param whose
        path ends with that param's path take its placement; other leaves (step counts) are
        moved to the mesh's device as plain tensors. Under ``pipeline`` each rank keeps only
        its stages' params, and drops the others' entries from the optimizer state's dicts.

        Args:
            params: ``{path: tensor}``.
            opt_state: The optimizer state for ``params`` (``opt.init(params)``).
            axes: Logical axes per path (default ``model.axes``), for transforms that need them.
            model: The functionalized model (``pipeline`` cuts it into stages).

        Returns:
            ``(params, opt_state)`` placed on the mesh; ``self.plan`` describes them.

        Raises:
            ParamTreeMismatchError: With ``model``, ``params`` has other paths than the model's.
            ParamShapeError: With ``model``, a param's shape is not the model's.
        """
        if model is not None:
            model.check_params(params)
            if axes is None:
                axes = model.axes
        plan = self.make_plan(params, axes, model)
        self._plan = plan
        placed = {p: _distribute(params[p], plan.mesh, plan.entries[p].storage) for p in plan.held}
        if plan.pipeline is not None:
            opt_state = _without(opt_state, set(plan.entries) - set(plan.held))
        return placed, _place_state(opt_state, plan, plan.mesh)

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
        self.check_inputs(params, batch)
        with activate(self.plan):
            return self.run(params, opt_state, batch)

    def check_inputs(self, params: Any, batch: Any) -> None:
        """Raise unless ``params`` are placed by this step's plan and the batch is consistent.

        The batch is checked across ranks (a collective) on the first call and whenever its
        shapes change; a call with the shapes of the last one only compares its signature.
        """
        check_placed(params, self.plan)
        signature = batch_signature(batch)
        if signature != self._checked_batch:
            check_batch(batch, self.mesh)
            self._checked_batch = signature

    def run(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
        """One step, inputs checked and the plan active (``d9d.jit`` does both outside its graph)."""
        split = self.plan.sequence_split
        if split is not None:
            batch = split.split_batch(batch)
        params, opt_state, metrics = self.fn(params, opt_state, batch)
        return params, opt_state, self._mean_over_ranks(metrics)

    def _mean_over_ranks(self, metrics: Any) -> Any:
        """Metrics averaged over the axes on which ranks hold different tokens."""
        names = tuple(self.mesh.mesh_dim_names or ())
        hops = [
            tuple(Partial("avg") if j == i else Replicate() for j in range(len(names)))
            for i, name in enumerate(names)
            if name in self.token_axes
        ]

        def mean(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor) or isinstance(leaf, DTensor):
                return leaf
            for placements in hops:  # one axis at a time: each an all-reduce of the metric
                leaf = DTensor.from_local(leaf, self.mesh, placements).full_tensor()
            return leaf

        return tree.map(mean, metrics) if hops else metrics

    def comms(self, params: Any, opt_state: Any, batch: Any) -> CommStats:
        """Run one step (eagerly, results dropped) and count its collectives per kind and axis."""
        pipeline = self.plan.pipeline
        labels = (
            {pipeline.tie_group.group_name: pipeline.axis}
            if pipeline is not None and pipeline.tie_group is not None
            else None
        )
        self.check_inputs(params, batch)  # its one-off all-gather of shapes is not the step's
        with CollectiveCounter(self.mesh, labels) as counter:
            self(params, opt_state, batch)
        return counter.stats

    def memory(self, params: Any, opt_state: Any) -> Memory:
        """Bytes this rank holds: params, grads (laid out like params) and optimizer state."""
        param_bytes = sum(_local_bytes(leaf) for leaf in tree.leaves(params))
        state_bytes = sum(_local_bytes(leaf) for leaf in tree.leaves(opt_state))
        return Memory(params=param_bytes, grads=param_bytes, opt_state=state_bytes)


def _local_bytes(leaf: Any) -> int:
    if isinstance(leaf, DTensor):
        leaf = leaf.to_local()
    return leaf.numel() * leaf.element_size() if isinstance(leaf, torch.Tensor) else 0


def _one_mesh(transforms: tuple[Transform, ...]) -> DeviceMesh:
    meshes = {id(t.mesh): t.mesh for t in transforms}
    if len(meshes) != 1:
        raise PlanError(
            f"transforms {[type(t).__name__ for t in transforms]} use {len(meshes)} different "
            "meshes; build one mesh with d9d.make_mesh(...) and pass it to every transform"
        )
    return next(iter(meshes.values()))


def _check_claims(transforms: tuple[Transform, ...]) -> None:
    owner: dict[str, Transform] = {}
    for t in transforms:
        for axis in t.claimed_axes():
            if axis in owner:
                raise PlanError(
                    f"mesh axis {axis!r} is claimed by both {owner[axis]} and {t}; give each "
                    "transform its own axis"
                )
            owner[axis] = t


def _check_all_axes_used(transforms: tuple[Transform, ...], mesh: DeviceMesh) -> None:
    owner = {axis for t in transforms for axis in t.claimed_axes()}
    for name, size in zip(mesh.mesh_dim_names or (), mesh.shape, strict=True):
        if size > 1 and name not in owner:
            raise PlanError(
                f"mesh axis {name!r} has size {size} but no transform uses it; add the transform "
                f"for it (e.g. d9d.shard_params(mesh, axis={name!r}) or replicate_axis={name!r}) "
                "or give it size 1"
            )


def _distribute(tensor: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> DTensor:
    if isinstance(tensor, DTensor):
        return tensor.redistribute(mesh, placements)
    return distribute_tensor(tensor.detach(), mesh, placements, src_data_rank=None)


def _onto_stage_mesh(entry: ParamPlan, pipeline: PipelineLayout) -> ParamPlan:
    """``entry`` laid out on the stage mesh (the pipeline axis dropped), with its stages."""
    i = pipeline.index

    def drop(placements: tuple) -> tuple:
        return (*placements[:i], *placements[i + 1 :]) or (Replicate(),)

    stages = pipeline.split.stages_of(entry.path)
    where = ", ".join(str(s) for s in stages)
    return replace(
        entry,
        storage=drop(entry.storage),
        compute=drop(entry.compute),
        grad=drop(entry.grad),
        stages=stages,
        reasons=(
            *entry.reasons,
            f"pipeline: held by stage {where} of {pipeline.split.count}"
            + (", grads summed over them (tied)" if len(stages) > 1 else ""),
        ),
    )


def _without(state: Any, paths: set[str]) -> Any:
    """``state`` with the entries keyed by ``paths`` dropped from its dicts."""
    if isinstance(state, Mapping):
        return type(state)({k: _without(v, paths) for k, v in state.items() if k not in paths})
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(_without(v, paths) for v in state))
    if isinstance(state, list | tuple):
        return type(state)(_without(v, paths) for v in state)
    return state


def _place_state(opt_state: Any, plan: Plan, mesh: DeviceMesh) -> Any:
    by_length = sorted(plan.entries, key=len, reverse=True)

    def place(path: str, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        for param in by_length:
            entry = plan.entries[param]
            if (path == param or path.endswith("." + param)) and tuple(leaf.shape) == entry.shape:
                return _distribute(leaf, mesh, entry.storage)
        return leaf.to(mesh.device_type) if leaf.device.type != "meta" else leaf

    return tree.map_with_path(place, opt_state)


def check_placed(params: Any, plan: Plan) -> None:
    """Raise unless ``params`` has the plan's paths, each a DTensor stored as planned."""
    if not isinstance(params, Mapping) or params.keys() != set(plan.held):
        given = set(params) if isinstance(params, Mapping) else set()
        missing = sorted(set(plan.held) - given)[:5]
        extra = sorted(given - set(plan.held))[:5]
        raise PlanError(
            f"params do not match the placed plan (missing {missing}, unexpected {extra}); "
            "pass the params returned by step.place(...) or by the previous step"
        )
    for path, leaf in params.items():
        entry = plan.entries[path]
        if not isinstance(leaf, DTensor) or tuple(leaf.placements) != entry.storage:
            got = tuple(leaf.placements) if isinstance(leaf, DTensor) else "a plain tensor"
            raise PlanError(
                f"param {path!r} is {got} but the plan stores it as {entry.storage}; pass the "
                "params returned by step.place(...) or by the previous step"
            )
        if leaf.shape != entry.shape:
            raise ParamShapeError(
                f"param {path!r} has shape {tuple(leaf.shape)} but the plan's is {entry.shape}; "
                "pass the params returned by step.place(...) or by the previous step"
            )
