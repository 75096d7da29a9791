"""The transformed step: ``place``, ``plan``, ``comms``, ``memory``, and the call.

A call runs the step body under one :class:`~d9d.core._context.StepContext`: the plan and the
transforms' runtimes, which the batch, ``d9d.value_and_grad`` and ``Model.apply`` consult.
"""

from __future__ import annotations

import abc
import functools
import numbers
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from .. import tree
from ..errors import IndivisibleError, PlanError
from ._apply import released_calls
from ._autodiff import averageable
from ._batch_check import BatchSignature, batch_signature, check_batch
from ._codec_statistics import codec_statistics
from ._comm_count import CollectiveCounter, CommStats
from ._context import StepContext, current, running
from ._donation import check_not_donated
from ._gather import distribute
from ._hidden_tensors import refuse_hidden_tensors
from ._memory import Memory, local_bytes, step_memory
from ._mesh import make_mesh
from ._param_plan import ParamPlan
from ._phase import Phase
from ._placed_trees import check_placed, check_placed_state, leaf_kinds, place_state, without
from ._plan import Plan
from ._runtime import Runtime
from ._structure import Axes

if TYPE_CHECKING:
    from ._model import Model

__all__ = ["OutermostStep", "TransformedStep", "order_transforms"]


class StepTransform(Protocol):
    """What a step asks of a transform (``d9d/core/_transform.py`` defines the base class that
    every transform derives from; this module, which it imports, only names the methods)."""

    name: ClassVar[str]
    phase: ClassVar[Phase]
    mesh: DeviceMesh

    def claimed_axes(self) -> tuple[str, ...]: ...
    def data_axes(self) -> tuple[str, ...]: ...
    def token_axes(self) -> tuple[str, ...]: ...
    def for_model(self, model: Model | None) -> StepTransform: ...
    def rewrite(self, entry: ParamPlan) -> ParamPlan: ...
    def lay_out(self, plan: Plan, model: Model | None) -> Plan: ...
    def runtime(self, plan: Plan, model: Model | None) -> Runtime | None: ...


class OutermostStep(abc.ABC):
    """Base of the step wrappers that must wrap every transform (``d9d.jit``, ``d9d.diloco``):
    a transform refuses to apply to one, since it would rewrite a step already compiled for one
    layout, or run its own calls around it."""

    @abc.abstractmethod
    def refusal_of(self, name: str) -> str:
        """The message refusing ``d9d.<name>`` applied to this step."""


class TransformedStep:
    """A step rewritten by transforms; call it like the step it wraps.

    ``place(params, opt_state)`` lays trees out on the mesh and builds ``plan``;
    ``comms(...)`` and ``memory(...)`` inspect one step.
    """

    def __init__(self, fn: Callable[..., Any], transforms: tuple[StepTransform, ...]) -> None:
        self.fn = fn
        self.transforms = order_transforms(transforms)
        self._mesh = _one_mesh(self.transforms)
        _check_claims(self.transforms)
        _check_kinds(self.transforms)
        self._plan: Plan | None = None
        self._runtimes: tuple[Runtime, ...] = ()
        self._codec_statistics = False  # the plan has a gather codec with a statistic
        self._checked_batch: BatchSignature | None = None
        self._state_kinds: tuple[str, ...] | None = None  # of the opt_state place returned
        functools.update_wrapper(self, fn, updated=())

    def with_transform(self, transform: StepTransform) -> TransformedStep:
        """This step with one more transform."""
        return TransformedStep(self.fn, (*self.transforms, transform))

    def sharing_plan(self, fn: Callable[..., Any]) -> TransformedStep:
        """``fn`` under this step's transforms, plan and runtimes (those that are ``shared``):
        a second step (an eval step, say) over the params this step placed, with no ``place``
        of its own."""
        other = TransformedStep(fn, self.transforms)
        other._mesh, other._plan = self._mesh, self._plan
        other._runtimes = tuple(r for r in self._runtimes if r.shared)
        other._codec_statistics = self._codec_statistics
        return other

    @property
    def mesh(self) -> DeviceMesh:
        """The transforms' mesh; when none has one (``remat`` alone), a one-rank mesh
        (``d9d.make_mesh(fsdp=1)``), made on first use."""
        if self._mesh is None:
            if dist.is_initialized() and dist.get_world_size() > 1:
                names = ", ".join(str(t) for t in self.transforms)
                raise PlanError(
                    f"the step's transforms ({names}) have no mesh, and this process is one "
                    f"of {dist.get_world_size()} ranks: pass mesh=d9d.make_mesh(...) to one "
                    "of them"
                )
            self._mesh = make_mesh(fsdp=1)
        return self._mesh

    @property
    def data_axes(self) -> tuple[str, ...]:
        """Mesh axes over which ranks see different batches."""
        return tuple(a for t in self.transforms for a in t.data_axes())

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Mesh axes over which ranks hold different tokens (data axes and the cp axis)."""
        return tuple(a for t in self.transforms for a in t.token_axes())

    def data_rank(self) -> tuple[int, int]:
        """``(dp_rank, dp_size)``: this rank's index among the data-parallel ranks, and their
        count; what a loader takes to yield this rank's batch (``TokenLoader(dp_rank=...,
        dp_size=...)``). :meth:`shard_batch` instead cuts that batch from a global one.

        Ranks that differ only on other axes (``tp``, ``cp``, ``pp``) get the same index.
        """
        index, count = 0, 1
        names = tuple(self.mesh.mesh_dim_names or ())
        coordinate = self.mesh.get_coordinate() or [0] * self.mesh.ndim
        for name, size, at in zip(names, self.mesh.shape, coordinate, strict=True):
            if name in self.data_axes:
                index, count = index * size + at, count * size
        return index, count

    batch_shard = data_rank  # the old name, kept for scripts written against it

    def shard_batch(self, batch: Any) -> Any:
        """This rank's slice (along dim 0) of a global ``batch``: rows ``dp_rank`` of
        ``dp_size`` equal parts, per :meth:`data_rank`.

        Raises:
            IndivisibleError: A leaf's batch size does not divide by the data-parallel ranks.
            TypeError: A leaf hides tensors from the pytree (a dataclass; a mapping not a
                dict), which would go whole to every rank.
        """
        index, count = self.data_rank()
        sizes = {t.shape[0] for t in tree.leaves(batch) if isinstance(t, torch.Tensor) and t.ndim}
        rows = next(iter(sizes)) if len(sizes) == 1 else None

        def take(path: str, leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0:
                if count > 1:
                    name = f"batch leaf {path!r}" if path else "the batch"
                    where = f"{count} data-parallel shards"
                    refuse_hidden_tensors(name, leaf, where, rows=rows)
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
        ``model`` is needed by ``pipeline``, which cuts it into stages, and by the rules that
        read what a param's module is (:meth:`~d9d.transforms.Transform.for_model`)."""
        _check_all_axes_used(self.transforms, self.mesh)
        transforms = tuple(t.for_model(model) for t in self.transforms)
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
            for transform in transforms:
                entry = transform.rewrite(entry)
            entries[path] = entry
        plan = Plan(self.mesh, entries)
        for transform in transforms:
            plan = transform.lay_out(plan, model)
        names = plan.names
        plan.token_groups = tuple(
            (plan.mesh.get_group(a).group_name, plan.mesh.shape[names.index(a)])
            for a in self.token_axes
            if a in names and plan.mesh.shape[names.index(a)] > 1
        )
        return plan

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
            DonatedTreeError: A leaf was donated to a ``d9d.jit`` call: it holds that
                call's new values.
        """
        check_not_donated(params, name="params")
        check_not_donated(opt_state, name="opt_state")
        if model is not None:
            model.check_params(params)
            if axes is None:
                axes = model.axes
        plan = self.make_plan(params, axes, model)
        self._runtimes = self._build_runtimes(plan, model)
        self._plan = plan
        self._codec_statistics = any(
            e.codec is not None and e.codec.statistic_op is not None for e in plan.entries.values()
        )
        placed = {p: distribute(params[p], plan.mesh, plan.entries[p].storage) for p in plan.held}
        if len(plan.held) < len(plan.entries):
            opt_state = without(opt_state, set(plan.entries) - set(plan.held))
        placed_state = place_state(opt_state, plan, plan.mesh)
        plan.state_bytes = _bytes_by_dtype(placed_state)
        self._state_kinds = leaf_kinds(placed_state)
        return placed, placed_state

    def _build_runtimes(self, plan: Plan, model: Model | None) -> tuple[Runtime, ...]:
        built = [(t, t.runtime(plan, model)) for t in self.transforms]
        runtimes = [(t, r) for t, r in built if r is not None]
        drivers = [t for t, r in runtimes if r.drives_differentiation]
        if len(drivers) > 1:
            raise PlanError(
                f"{drivers[0]} and {drivers[1]} both run d9d.value_and_grad themselves (over "
                "microbatches of their own, or across replica groups); keep one of them, or "
                "drop the other's microbatches"
            )
        traits = {name: (t, how) for t, r in runtimes for name, how in r.traits().items()}
        for holder, runtime in runtimes:
            for name, why in runtime.refusals().items():
                if name in traits:
                    doer, how = traits[name]
                    raise PlanError(f"{doer} {how}, but under {holder} {why}")
        return tuple(r for _, r in runtimes)

    @property
    def runtimes(self) -> tuple[Runtime, ...]:
        """The transforms' runtimes for the placed plan, in transform order (none before
        ``place``)."""
        return self._runtimes

    def context(self) -> StepContext:
        """A fresh context for one call of the step (the plan and the runtimes)."""
        return StepContext(self.plan, self._runtimes)

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
        for i, arg in enumerate((params, opt_state, batch)):  # d9d.jit checks them itself
            check_not_donated(arg, name=f"argument {i}")
        self.check_inputs(params, opt_state, batch)
        step = self.context()
        # Eager only (d9d.jit runs ``run`` in its graph): what ``value_and_grad`` did not
        # release (a forward-only ``Model.apply``'s call) is released as the step returns.
        with running(step), released_calls(step, True):
            return self.run(params, opt_state, batch)

    def check_inputs(self, params: Any, opt_state: Any, batch: Any) -> None:
        """Raise unless ``params`` and ``opt_state`` are laid out as ``place`` laid them out
        and the batch is consistent.

        The batch is checked across ranks (a collective) on the first call and whenever its
        shapes change; a call with the shapes of the last one only compares its signature.
        """
        check_placed(params, self.plan)
        if self._state_kinds is not None:
            check_placed_state(opt_state, self._state_kinds)
        signature = batch_signature(batch)
        if signature != self._checked_batch:
            check_batch(batch, self.mesh)
            self._checked_batch = signature

    def run(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
        """One step, inputs checked and the step running (``d9d.jit`` does both outside its
        graph)."""
        for runtime in self._runtimes:
            params, opt_state = runtime.start_step(params, opt_state)
        given = params, opt_state
        step = current()
        # Under d9d.jit too: the graph then all-reduces them once, as the eager step does.
        if self._codec_statistics and step is not None:
            step.codec_statistics = codec_statistics(self.plan, params)
        for runtime in self._runtimes:
            batch = runtime.on_batch(batch)
            params = runtime.enter_step(params)
        params, opt_state, metrics = self.fn(params, opt_state, batch)
        for runtime in reversed(self._runtimes):
            params = runtime.exit_step(params)
        # Every runtime is asked, also after a refusal: its asking may be a collective.
        if not all([runtime.commit() for runtime in self._runtimes]):
            params, opt_state = given
        for runtime in self._runtimes:
            runtime.end_step(params, opt_state)
        return params, opt_state, self._mean_over_ranks(metrics)

    def _averaged_axes(self) -> list[int]:
        """Indices of the mesh axes, of more than one rank, on which ranks hold different
        tokens: those the metrics are averaged over."""
        names = tuple(self.mesh.mesh_dim_names or ())
        return [i for i, n in enumerate(names) if n in self.token_axes and self.mesh.shape[i] > 1]

    def _mean_over_ranks(self, metrics: Any) -> Any:
        """Metrics averaged over the axes on which ranks hold different tokens (integer and
        boolean ones in float64). A Python number is averaged as a float64 0-d tensor: a rank's
        own value is no global one (``loss.item()`` of a token mean is the rank's share of it,
        rescaled: 1.22 and 9.86 on two fsdp ranks for a loss of 5.54), and a constant (an lr,
        a flag) keeps its value."""
        ndim = self.mesh.ndim
        hops = [
            tuple(Partial("avg") if j == i else Replicate() for j in range(ndim))
            for i in self._averaged_axes()
        ]

        def mean(leaf: Any) -> Any:
            if isinstance(leaf, numbers.Real):
                leaf = torch.tensor(float(leaf), dtype=torch.float64, device=self.mesh.device_type)
            if not isinstance(leaf, torch.Tensor) or isinstance(leaf, DTensor):
                return leaf
            leaf = averageable(leaf)  # an integer count: its mean in float64
            for placements in hops:  # one axis at a time: each an all-reduce of the metric
                leaf = DTensor.from_local(leaf, self.mesh, placements).full_tensor()
            return leaf

        return tree.map(mean, metrics) if hops else metrics

    def comms(self, params: Any, opt_state: Any, batch: Any) -> CommStats:
        """Run one step (eagerly, results dropped) and count its collectives per kind and axis."""
        for runtime in self.runtimes:
            refusal = runtime.comms_refusal()
            if refusal is not None:
                raise PlanError(refusal)
        labels = {k: v for r in self.runtimes for k, v in r.group_labels().items()}
        self.check_inputs(params, opt_state, batch)  # its all-gather of shapes is not the step's
        with CollectiveCounter(self.mesh, labels) as counter:
            self(params, opt_state, batch)
        return counter.stats

    def memory(self, params: Any, opt_state: Any) -> Memory:
        """Bytes this rank holds when the step body updates: params, grads (laid out as the
        update sees them, as each param's optimizer state is kept: ZeRO-1 all-reduces a
        block's grads and keeps their slices) and optimizer state, the state kept on the
        plan's state device (the host) counted apart; and, when a runtime reduces the grads
        once a step (:attr:`Runtime.accumulates_grads`), the whole grads it holds until then
        (``Memory.accumulated_grads``) and the wider copies of narrower params it
        differentiates meanwhile (``Memory.widened_params``)."""
        return step_memory(self.plan, self.runtimes, params, opt_state)


def _bytes_by_dtype(state: Any) -> dict[str, int]:
    """This rank's bytes of the tensors of ``state`` per dtype name, largest first."""
    totals: dict[str, int] = {}
    for leaf in tree.leaves(state):
        if isinstance(leaf, torch.Tensor):
            name = str(leaf.dtype).removeprefix("torch.")
            totals[name] = totals.get(name, 0) + local_bytes(leaf)
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def order_transforms(transforms: tuple[StepTransform, ...]) -> tuple[StepTransform, ...]:
    """``transforms`` in the order they apply: by phase, then by name (``d9d/core/_phase.py``)."""
    return tuple(sorted(transforms, key=lambda t: (int(t.phase), t.name)))


def _one_mesh(transforms: tuple[StepTransform, ...]) -> DeviceMesh | None:
    """The mesh of the transforms that have one (``remat`` may have none), or None."""
    meshes = {id(t.mesh): t.mesh for t in transforms if t.mesh is not None}
    if len(meshes) > 1:
        raise PlanError(
            f"transforms {[type(t).__name__ for t in transforms]} use {len(meshes)} different "
            "meshes; build one mesh with d9d.make_mesh(...) and pass it to every transform"
        )
    return next(iter(meshes.values()), None)


def _check_claims(transforms: tuple[StepTransform, ...]) -> None:
    owner: dict[str, StepTransform] = {}
    for t in transforms:
        for axis in t.claimed_axes():
            if axis in owner:
                raise PlanError(
                    f"mesh axis {axis!r} is claimed by both {owner[axis]} and {t}; give each "
                    "transform its own axis"
                )
            owner[axis] = t


def _check_kinds(transforms: tuple[StepTransform, ...]) -> None:
    """One transform of each kind: two of one kind (on different axes) rewrite the same
    fields of the plan and hook the same places of the step, which none of them is built to
    share (two ``context_parallel`` cut every sequence twice and ran wrong losses)."""
    seen: dict[str, StepTransform] = {}
    for t in transforms:
        if t.name in seen:
            raise PlanError(
                f"the step has two {t.name} transforms, {seen[t.name]} and {t}; a step takes "
                f"one of each kind: keep one {t.name}(...) with every axis and option it "
                "needs (HSDP is one shard_params(mesh, 'fsdp', replicate_axis='dp'))"
            )
        seen[t.name] = t


def _check_all_axes_used(transforms: tuple[StepTransform, ...], mesh: DeviceMesh) -> None:
    owner = {axis for t in transforms for axis in t.claimed_axes()}
    for name, size in zip(mesh.mesh_dim_names or (), mesh.shape, strict=True):
        if size > 1 and name not in owner:
            raise PlanError(
                f"mesh axis {name!r} has size {size} but no transform uses it; add the transform "
                f"for it (e.g. d9d.shard_params(mesh, axis={name!r}) or replicate_axis={name!r}) "
                "or give it size 1"
            )
