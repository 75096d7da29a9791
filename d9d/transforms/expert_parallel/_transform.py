"""``expert_parallel``: routed experts sharded over a mesh axis; that axis a data axis for the
rest of the model.

A stacked expert weight (logical axes ``("experts", ...)`` with an ``expert_mlp`` dim: the
``w_gate``/``w_up``/``w_down`` of a ``d9d.moe`` layer), and every param of a Hugging Face
experts module of ``transformers``' interface (its weights and biases, each ``[E, ...]``:
known by its module, as GPT-OSS's ``down_proj_bias [E, H]`` has a router weight's axes),
is stored, computed with and updated
``Shard(0)`` over the axis: each rank holds ``E / ep`` experts and their optimizer state.
Every other param is replicated over the axis and its grad averaged over it, as over a
data-parallel axis, since the axis' ranks pass different batches.

The owner's grad of an expert is the sum, over the ep ranks, of the grads of their losses
(the rows of every ep rank pass through it), while the step's loss is the mean of the ranks'
losses: the plan's ``grad_scale`` of ``1 / ep`` makes it one device's, with no reduction over
the axis (``docs/moe.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from ...core._param_plan import ParamPlan
from ...core._phase import Phase
from ...core._plan import Plan
from ...core._transform import Transform
from ...errors import PlanError
from ...hf import family_of
from ...hf._experts import experts_call_names, experts_interface_refusal
from ...moe import Experts, MoE
from ._hf_experts import HFExperts, hf_expert_params
from ._runtime import ExpertParallelRuntime

if TYPE_CHECKING:
    from ...core._model import Model

__all__ = ["ExpertParallel", "expert_parallel", "is_expert_weight"]


def is_expert_weight(entry: ParamPlan) -> bool:
    """Whether ``entry`` is a stacked routed-expert weight by its logical axes alone: axes
    starting with ``experts`` and naming an ``expert_mlp`` dim (a router's are ``("experts",
    "embed")``). A Hugging Face experts module's params are known by their module instead
    (``for_model``): a bias ``[E, H]`` may have a router's axes."""
    axes = entry.axes
    return axes is not None and len(axes) > 1 and axes[0] == "experts" and "expert_mlp" in axes


@dataclass(frozen=True)
class ExpertParallel(Transform):
    """The ``expert_parallel`` transform; build it with :func:`expert_parallel`."""

    name: ClassVar[str] = "expert_parallel"
    phase: ClassVar[Phase] = Phase.COMPUTE_LAYOUT
    mesh: DeviceMesh
    axis: str = "ep"
    hf_expert_params: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    """The params of the planned model's Hugging Face experts modules (set by ``for_model``)."""

    def __post_init__(self) -> None:
        self._axis_index(self.axis, "axis")

    def __str__(self) -> str:
        return f"expert_parallel(axis={self.axis!r})"

    def claimed_axes(self) -> tuple[str, ...]:
        return (self.axis,)

    def data_axes(self) -> tuple[str, ...]:
        return (self.axis,)

    @property
    def size(self) -> int:
        """Ranks on the axis."""
        return self.mesh.shape[self._axis_index(self.axis, "axis")]

    def for_model(self, model: Model | None) -> ExpertParallel:
        if model is None:
            return self
        return replace(self, hf_expert_params=hf_expert_params(model))

    def rewrite(self, entry: ParamPlan) -> ParamPlan:
        index = self._axis_index(self.axis, "axis")
        if not (is_expert_weight(entry) or entry.path in self.hf_expert_params):
            return entry.with_axis(
                index,
                storage=Replicate(),
                compute=Replicate(),
                grad=Partial("avg"),
                reason=(
                    f"{self}: replicated over {self.axis!r}, whose ranks pass different "
                    "batches; grads all-reduced (mean)"
                ),
            )
        experts, size = entry.shape[0], self.size
        if experts % size:
            raise PlanError(
                f"{self}: {entry.path!r} holds {experts} experts, which do not split over the "
                f"{size} ranks of {self.axis!r}; use an expert count divisible by {size}, or an "
                f"{self.axis!r} axis of a size that divides {experts}"
            )
        entry = entry.with_axis(
            index,
            storage=Shard(0),
            compute=Shard(0),
            grad=Shard(0),
            reason=(
                f"{self}: {experts // size} of {experts} experts per rank of {self.axis!r}; "
                f"tokens dispatched to them and combined back (all-to-all), grads scaled by "
                f"1/{size} (their rows come from every rank of {self.axis!r}), not reduced"
            ),
        )
        return replace(entry, grad_scale=entry.grad_scale / size)

    def lay_out(self, plan: Plan, model: Model | None) -> Plan:
        _experts_modules(self, plan, model)
        return plan

    def runtime(self, plan: Plan, model: Model | None) -> ExpertParallelRuntime:
        group = self.mesh.get_group(self.axis)
        layers, hf_experts = _experts_modules(self, plan, model)
        return ExpertParallelRuntime(layers, group, hf_experts)


def _experts_modules(
    transform: ExpertParallel, plan: Plan, model: Model | None
) -> tuple[tuple[str, ...], tuple[HFExperts, ...]]:
    """The paths of the d9d.moe MoE layers whose experts modules own the plan's expert
    weights, and the Hugging Face experts modules that own the others, checked."""
    hf_params = hf_expert_params(model) if model is not None else frozenset()
    owners: dict[str, list[str]] = {}
    for entry in plan.entries.values():
        if is_expert_weight(entry) or entry.path in hf_params:
            owners.setdefault(entry.path.rpartition(".")[0], []).append(entry.path)
    if not owners:
        raise PlanError(
            f"{transform}: the model has no routed experts (no param whose logical axes start "
            "with 'experts' and name 'expert_mlp', as the stacked experts of d9d.moe and of "
            "transformers' MoE models have); use a model with routed experts, or treat "
            f"{transform.axis!r} as a data axis: "
            f"d9d.shard_params(mesh, replicate_axis={transform.axis!r})"
        )
    if model is None:
        raise PlanError(
            f"{transform} intercepts the model's experts modules and needs the model: call "
            "step.place(params, opt_state, model=model)"
        )
    layers, hf_experts = [], []
    for path, params in owners.items():
        module = model.structure.modules.get(path)
        if isinstance(module, Experts):
            layers.append(_moe_layer(transform, model, path, module))
        else:
            hf_experts.append(_hf_experts(transform, plan, model, path, params))
    return tuple(layers), tuple(hf_experts)


def _moe_layer(transform: ExpertParallel, model: Model, path: str, module: Experts) -> str:
    """The path of the d9d.moe MoE layer whose experts ``module`` (at ``path``) is, checked."""
    layer_path = path.rpartition(".")[0]
    layer = model.structure.modules.get(layer_path)
    if not isinstance(layer, MoE) or layer.experts is not module:
        raise PlanError(
            f"{transform}: the experts module {path!r} is not the experts of a d9d.moe MoE "
            f"layer ({layer_path!r} is {type(layer).__name__}), whose dispatch(x, "
            "expert_ids, weights) expert_parallel replaces; call the experts from a "
            "d9d.moe.MoE layer"
        )
    return layer_path


def _hf_experts(
    transform: ExpertParallel, plan: Plan, model: Model, path: str, params: list[str]
) -> HFExperts:
    """The Hugging Face experts module at ``path`` (owning the expert weights ``params``) as
    the runtime runs it, or a PlanError saying why it cannot and the fix for its family."""
    module = model.structure.modules.get(path)
    experts = plan.entries[params[0]].shape[0]
    why = experts_interface_refusal(module, experts)
    if why is None:
        return path, experts, experts_call_names(module)
    family = family_of(model.module)
    if family is None:
        fix = "build the model's MoE layers from d9d.moe"
    elif family == "qwen3_moe":
        fix = "d9d.checkpoint.import_hf_moe converts a Qwen3-MoE checkpoint to d9d.models.MoE"
    else:
        fix = (
            f"expert_parallel cannot run the {family!r} family's experts; shard them with "
            f"d9d.shard_params(mesh, axis={transform.axis!r}) instead"
        )
    raise PlanError(
        f"{transform}: {params[0]!r} belongs to module {path!r} ({type(module).__name__}), "
        f"which expert_parallel cannot run on the rows it dispatches: {why}; {fix}"
    )


def expert_parallel(mesh: DeviceMesh, axis: str = "ep") -> ExpertParallel:
    """Shard the routed experts over a mesh axis; the axis is a data axis for the rest.

    Each rank of ``axis`` stores, computes with and updates ``E / ep`` experts of every
    ``d9d.moe`` layer or Hugging Face experts module (its stacked expert weights, and every
    ``[E, ...]`` param of a Hugging Face experts module, biases too, ``Shard(0)`` over
    ``axis``, with their optimizer state) and passes its own batch
    (:meth:`~d9d.transforms.TransformedStep.data_rank` counts ``axis``). Each MoE layer's
    ``dispatch(x, expert_ids, weights)`` becomes ``d9d.kernels.dispatch`` (each token sent
    once to every rank owning one of its experts, by uneven all-to-all), the local experts'
    grouped GEMMs, and ``d9d.kernels.combine``
    (each token's weighted sum over a rank's experts sent back); the backward runs the
    reverse all-to-alls. A Hugging Face experts module of ``transformers``' interface
    (``experts(hidden_states, top_k_index, top_k_weights)``, stacked ``[E, ...]`` params) runs
    the same way: its call becomes dispatch, its own forward on this rank's experts, and
    combine (``docs/huggingface.md``). Dense params are replicated over ``axis`` and their
    grads averaged over it; the loss is the token mean over every rank's batch. The experts'
    grads are one device's (``docs/moe.md``). Composes with ``shard_params`` on another axis:
    dense params FSDP over it, expert weights sharded over it on their next dim (expert FSDP).

    Args:
        mesh: The mesh, from :func:`d9d.make_mesh`.
        axis: The mesh axis to shard experts over. Default ``"ep"``.

    Returns:
        The transform: decorate a step with it.

    Raises:
        PlanError: ``axis`` is not on the mesh; when placed, the model has no routed
            experts, an expert count does not divide by the axis' size, no model is given, or
            an experts module is neither ``d9d.moe``'s nor of ``transformers``' interface.

    Example:
        >>> import d9d, torch
        >>> from d9d.models import MoE, MoEConfig
        >>> from d9d.testing import run_on_ranks
        >>> def rank_fn():
        ...     mesh = d9d.make_mesh("cpu", ep=2)
        ...     model = d9d.functionalize(MoE(MoEConfig.tiny()))
        ...     step = expert_parallel(mesh)(lambda p, s, b: (p, s, {}))
        ...     params, _ = step.place(model.params, (), model=model)
        ...     return params["layers.1.mlp.experts.w_gate"].to_local().shape
        >>> run_on_ranks(rank_fn, 2)
        [torch.Size([3, 64, 40]), torch.Size([3, 64, 40])]
    """
    return ExpertParallel(mesh, axis)
