"""``tensor_parallel``: Megatron tensor parallelism with sequence parallelism, from logical axes.

A param whose logical axis maps to the tensor-parallel mesh axis is stored and used as a shard
of that dim: ``Shard(0)`` for the weights of column-parallel linears (q, k, v, gate, up: axes
``heads``, ``kv_heads``, ``mlp``) and of the vocab-parallel embedding and head (``vocab``),
``Shard(1)`` for row-parallel linears (output projections). Other params are replicated; with
sequence parallelism they act on a slice of the sequence (norms) or of the heads, so their
grads are summed over the axis. Activations move between those layouts at module boundaries
(``_runtime.py`` beside this file).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from ...core._mesh_hash import pin_hash
from ...core._param_plan import ParamPlan
from ...core._phase import Phase
from ...core._plan import Plan
from ...core._transform import Transform
from ...errors import IndivisibleError, PlanError
from ._layout import HEAD_AXES, PARTIAL_GRAD_AXES, ActivationLayout
from ._runtime import TensorParallelRuntime

if TYPE_CHECKING:
    from ...core._model import Model

__all__ = ["DEFAULT_RULES", "TensorParallel", "tensor_parallel"]

DEFAULT_RULES: Mapping[str, str | None] = {
    "heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "vocab": "tp",
    "embed": None,
    "head_dim": None,
    "latent": None,  # latent attention's down-projections (MLA's q_a/kv_a): feed the rank's heads
    "mlp_scale": None,  # an activation's scalars on the mlp's hidden width (xIELU's alpha)
    "experts": None,  # MoE routed experts and router: replicated over tp (shared experts: mlp)
    "expert_mlp": None,
}
"""Logical axis -> mesh axis (``"tp"`` stands for the transform's axis; None: replicated)."""

# What a param gets when no rule names its dims: nothing (None), or nn.Linear's defaults.
_UNNAMED = (None, "out", "in")


@dataclass(frozen=True)
class TensorParallel(Transform):
    """The ``tensor_parallel`` transform; build it with :func:`tensor_parallel`."""

    name: ClassVar[str] = "tensor_parallel"
    phase: ClassVar[Phase] = Phase.COMPUTE_LAYOUT
    mesh: DeviceMesh
    axis: str = "tp"
    sequence_parallel: bool = True
    loss_parallel: bool = True
    rules: Mapping[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._axis_index(self.axis, "axis")

    def __str__(self) -> str:
        return f"tensor_parallel(axis={self.axis!r})"

    def claimed_axes(self) -> tuple[str, ...]:
        return (self.axis,)

    def runtime(self, plan: Plan, model: Model | None) -> TensorParallelRuntime:
        layout = ActivationLayout(
            mesh=pin_hash(self.mesh[self.axis]),
            axis=self.axis,
            index=plan.names.index(self.axis),
            rank=self._coordinate(self.axis),
            sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel,
        )
        runtime = TensorParallelRuntime(layout, plan)
        if model is not None:  # check the model now, before any collective
            runtime.roles(model.structure)
        return runtime

    def _target(self, name: str | None, entry: ParamPlan) -> str | None:
        rules, path = {**DEFAULT_RULES, **self.rules}, entry.path
        if name not in rules and name in _UNNAMED:
            raise PlanError(_unnamed_message(entry, name))
        if name not in rules:
            raise PlanError(
                f"param {path!r} has logical axis {name!r}, which tensor_parallel has no rule "
                f"for (rules cover {sorted(rules)}); pass rules={{{name!r}: None}} to replicate "
                f"it or {{{name!r}: {self.axis!r}}} to shard it, or give the param known axes "
                "with d9d.functionalize(module, axes={...})"
            )
        target = rules[name]
        return self.axis if target == "tp" else target

    def rewrite(self, entry: ParamPlan) -> ParamPlan:
        if entry.axes is None:
            raise PlanError(
                f"param {entry.path!r} has no logical axes, so tensor_parallel cannot place it; "
                "pass them with d9d.functionalize(module, axes={path regex: names}) and "
                "step.place(..., axes=model.axes)"
            )
        index = self._axis_index(self.axis, "axis")
        dims = [d for d, name in enumerate(entry.axes) if self._target(name, entry) == self.axis]
        if len(dims) > 1:
            raise PlanError(
                f"param {entry.path!r} has logical axes {entry.axes}, of which {len(dims)} map "
                f"to {self.axis!r}; a param is sharded over one dim: map only one to it"
            )
        if not dims:
            per_head = any(name in PARTIAL_GRAD_AXES for name in entry.axes)
            partial = self.sequence_parallel or per_head
            return entry.with_axis(
                index,
                storage=Replicate(),
                compute=Replicate(),
                grad=Partial("sum") if partial else Replicate(),
                reason=(
                    f"{self}: replicated over {self.axis!r}"
                    + (
                        ", used on a slice of the sequence or of the heads: grads summed"
                        if partial
                        else ""
                    )
                ),
            )
        dim, size = dims[0], self.mesh.shape[index]
        name = entry.axes[dim]
        if name in HEAD_AXES and entry.shape[dim] % size:
            raise IndivisibleError(
                f"param {entry.path!r}: dim {dim} ({name}, {entry.shape[dim]}) does not divide "
                f"over {size} {self.axis!r} ranks; each rank must hold whole heads"
            )
        kind = {0: "column-parallel (output dim)", 1: "row-parallel (input dim)"}.get(dim, "")
        uneven = (
            f", uneven: padded to {-(-entry.shape[dim] // size)} per rank"
            if entry.shape[dim] % size
            else ""
        )
        return entry.with_axis(
            index,
            storage=Shard(dim),
            compute=Shard(dim),
            grad=Shard(dim),
            reason=f"{self}: dim {dim} ({name}) sharded over {self.axis!r}, {kind}{uneven}",
        )


def _unnamed_message(entry: ParamPlan, name: str | None) -> str:
    """Why a param no rule named cannot be placed, and the rules that would place it."""
    suffix = re.escape(".".join(entry.path.split(".")[-2:]))
    whole = ("embed",) * len(entry.shape)
    what = "no logical axis names" if name is None else f"nn.Linear's default axes {entry.axes}"
    return (
        f"param {entry.path!r} (shape {tuple(entry.shape)}) has {what}: no rule of d9d.hf "
        "(the model's tp plan or d9d's tables) nor of axes= names it, so tensor_parallel "
        "cannot tell whether to shard it. To keep it whole on every tp rank (a norm or scale "
        "over the hidden size, or a projection run replicated), pass "
        f"d9d.functionalize(module, axes={{r'\\.{suffix}$': {whole}}}) (tensor_parallel "
        "refuses a weight kept whole beside column-parallel linears by name), or, for a param "
        "only the rank's heads or mlp shard read (a per-head norm, an activation's scalar), "
        "name it 'head_dim' or 'mlp_scale' so that its grads are summed over tp; to shard it, "
        "name the split dim "
        "'heads', 'kv_heads' or 'mlp' (dim 0 of a column-parallel weight, dim 1 of a "
        "row-parallel one) and the other 'embed'"
    )


def tensor_parallel(
    mesh: DeviceMesh,
    axis: str = "tp",
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    rules: Mapping[str, str | None] | None = None,
) -> TensorParallel:
    """Megatron tensor parallelism over a mesh axis, placed from the params' logical axes.

    Column-parallel q/k/v and gate/up projections (``heads``, ``kv_heads``, ``mlp`` on the
    output dim), row-parallel output projections (the same axes on the input dim), a
    vocab-parallel embedding and head (``vocab``). Each attention and MLP gathers its input
    once and reduces its output once. With ``sequence_parallel`` the residual stream and the
    norms between blocks hold ``S / tp`` positions per rank: the gather is an all-gather and
    the reduction a reduce-scatter over the sequence (dim 1 of ``[batch, seq, ...]``
    activations). With ``loss_parallel`` the head's logits stay sharded over the vocab, as a
    DTensor that :func:`d9d.losses.cross_entropy` reduces without gathering them. Every rank
    of the axis passes the same batch. A vocab-parallel embedding's ``padding_idx`` stays the
    global padding row (the only row whose gradient is zero).

    Works on any model whose linears and embeddings have logical axes: the d9d Llama declares
    them; give a Hugging Face model path rules with ``functionalize(module, axes=...)``. A
    module declared position-wise (``position_wise = True``: a dropless ``d9d.moe.MoE``) keeps
    the input it gets, so its weights whole on the axis (routed experts, router) run on the
    rank's ``S / tp`` positions under sequence parallelism, their grads summed over the axis,
    while its children with sharded linears (shared experts) gather their input as a dense
    MLP does.
    Composes with ``shard_params`` (which then shards another dim of each weight).

    Args:
        mesh: The mesh, from :func:`d9d.make_mesh`.
        axis: The mesh axis to split over. Default ``"tp"``.
        sequence_parallel: Shard the residual stream over the sequence. Default True.
        loss_parallel: Keep logits vocab-sharded for the loss. Default True.
        rules: Logical axis -> mesh axis (``"tp"`` or None), added to :data:`DEFAULT_RULES`.

    Returns:
        The transform: decorate a step with it.

    Raises:
        PlanError: ``axis`` is not on the mesh; when placing, a param has no logical axes, an
            axis with no rule, or two dims on the axis; when placing with ``model=`` (else
            at the first call, before any collective), a param sharded on the axis whose
            module is not an ``nn.Linear`` or ``nn.Embedding`` (GPT-2's ``Conv1D``), a module
            with column-parallel linears beside a weight whole on the axis, or, under
            sequence parallelism, a block child or head with a weight whole on the axis, no
            sharded linear and no position-wise declaration; at a call, ``labels=`` (a
            model's own loss) under ``loss_parallel``, ``output_router_logits`` under
            sequence parallelism, a vocab-sharded embedding with ``max_norm`` or
            ``scale_grad_by_freq``, or a module in training mode that would draw random
            numbers (an ``nn.Dropout`` with ``p > 0``, an ``attention_dropout`` or a router's
            ``jitter_noise`` above 0), which the axis's ranks would draw inconsistently.
        IndivisibleError: When placing, a heads dim does not divide over the axis.

    Example:
        >>> import d9d, torch
        >>> from d9d.testing import run_on_ranks
        >>> def rank_fn():
        ...     mesh = d9d.make_mesh("cpu", tp=2)
        ...     step = tensor_parallel(mesh)(lambda p, s, b: (p, s, {}))
        ...     params, _ = step.place({"w": torch.ones(4, 6)}, (), axes={"w": ("mlp", "embed")})
        ...     return params["w"].to_local().shape
        >>> run_on_ranks(rank_fn, 2)
        [torch.Size([2, 6]), torch.Size([2, 6])]
    """
    return TensorParallel(mesh, axis, sequence_parallel, loss_parallel, dict(rules or {}))
