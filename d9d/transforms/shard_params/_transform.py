"""``shard_params``: FSDP (ZeRO-3), ZeRO-1/2, HSDP and DDP as differences of the storage,
compute, grad and optimizer-state layouts.

ZeRO-3: a param is stored ``Shard(dim)`` on the sharding axis (its first dim no other axis
shards) and used ``Replicate``: each block gathers its params when it starts and drops them
when it ends; the gradient comes back ``Partial`` (each rank's batch) and is
reduce-scattered to the stored shard. ZeRO-1/2: the param is stored and used whole, its
optimizer state kept ``Shard(dim)``, its grad reduce-scattered (ZeRO-2) or all-reduced and
sliced (ZeRO-1). A replicate axis stores and uses the param whole and all-reduces its
gradient. All average the gradient over their ranks, so a step equals one device fed every
rank's batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from ...core._param_plan import Cast, ParamPlan, with_placement
from ...core._phase import Phase
from ...core._plan import Plan
from ...core._transform import Transform
from ...errors import PlanError
from ._runtime import ShardParamsRuntime
from ._schedule import Schedule
from ._stage import ZeroStage

Sharded = Literal["params", "grads", "opt_state"]
"""``shard=``: what the axis shards beyond the optimizer state."""

SHARDED: tuple[Sharded, ...] = ("params", "grads", "opt_state")
"""What ``shard=`` may shard beyond the optimizer state, widest first (ZeRO-3, -2, -1)."""

if TYPE_CHECKING:
    from ...core._model import Model

__all__ = ["ShardParams", "shard_params"]


@dataclass(frozen=True)
class ShardParams(Transform):
    """The ``shard_params`` transform; build it with :func:`shard_params`."""

    name: ClassVar[str] = "shard_params"
    phase: ClassVar[Phase] = Phase.STORAGE
    mesh: DeviceMesh
    axis: str | None = "fsdp"
    replicate_axis: str | None = None
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    microbatches: int = 1
    prefetch: bool = True
    shard: Sharded = "params"
    opt_state_device: str | None = None

    def __post_init__(self) -> None:
        if self.opt_state_device not in (None, "cpu"):
            raise PlanError(
                f"shard_params got opt_state_device={self.opt_state_device!r}; pass 'cpu' "
                "(optimizer state in host memory) or None (on the mesh's device)"
            )
        if self.shard not in SHARDED:
            raise PlanError(
                f"shard_params got shard={self.shard!r}; choose 'params' (ZeRO-3: params, "
                "grads and optimizer state sharded), 'grads' (ZeRO-2: grads and optimizer "
                "state) or 'opt_state' (ZeRO-1: optimizer state only)"
            )
        if self.shard != "params" and self.axis is None:
            raise PlanError(
                f"shard_params(shard={self.shard!r}) shards over axis=, but axis=None; pass "
                "the axis to shard over (axis='fsdp')"
            )
        if self.shard != "params":
            for option, value in (
                ("reshard_after_forward", self.reshard_after_forward),
                ("prefetch", self.prefetch),
            ):
                if value is not True:
                    raise PlanError(
                        f"shard_params(shard={self.shard!r}) got {option}={value!r}: ZeRO-1/2 "
                        "compute with whole params and gather none in the forward: nothing "
                        f"to reshard or prefetch; drop {option}= or use shard='params' (ZeRO-3)"
                    )
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise PlanError(
                f"shard_params needs microbatches >= 1, got microbatches={self.microbatches!r}"
            )
        if not isinstance(self.prefetch, bool):
            raise PlanError(
                f"shard_params needs prefetch=True or False, got prefetch={self.prefetch!r}"
            )
        if self.axis is None and self.replicate_axis is None:
            raise PlanError(
                "shard_params needs axis= (FSDP), replicate_axis= (DDP), or both (HSDP)"
            )
        if self.axis is not None and self.axis == self.replicate_axis:
            raise PlanError(
                f"shard_params(axis={self.axis!r}, replicate_axis={self.replicate_axis!r}) uses one "
                "axis twice; shard over one axis and replicate over another"
            )
        if self.axis is not None:
            self._axis_index(self.axis, "axis")
        if self.replicate_axis is not None:
            self._axis_index(self.replicate_axis, "replicate_axis")

    def __str__(self) -> str:
        zero = "" if self.shard == "params" else f", shard={self.shard!r}"
        host = (
            "" if self.opt_state_device is None else f", opt_state_device={self.opt_state_device!r}"
        )
        return (
            f"shard_params(axis={self.axis!r}, replicate_axis={self.replicate_axis!r}{zero}{host})"
        )

    def claimed_axes(self) -> tuple[str, ...]:
        return tuple(a for a in (self.replicate_axis, self.axis) if a is not None)

    def data_axes(self) -> tuple[str, ...]:
        return self.claimed_axes()

    def runtime(self, plan: Plan, model: Model | None) -> ShardParamsRuntime:
        del model
        return ShardParamsRuntime(plan, self.microbatches, self.opt_state_device)

    def rewrite(self, entry: ParamPlan) -> ParamPlan:
        if self.opt_state_device is not None:
            entry = replace(entry, state_device=self.opt_state_device)
        if entry.dtype.is_floating_point:
            codec = None if self.param_dtype is None else Cast(self.param_dtype)
            entry = replace(entry, codec=codec, reduce_dtype=self.reduce_dtype)
        average = Partial("avg")
        if self.replicate_axis is not None:
            entry = entry.with_axis(
                self._axis_index(self.replicate_axis, "replicate_axis"),
                storage=Replicate(),
                compute=Replicate(),
                grad=average,
                reason=f"{self}: replicated over {self.replicate_axis!r}, grads all-reduced (mean)",
            )
        if self.axis is None:
            return entry
        index = self._axis_index(self.axis, "axis")
        if not entry.shape:
            return entry.with_axis(
                index,
                storage=Replicate(),
                compute=Replicate(),
                grad=average,
                reason=f"{self}: a 0-d param cannot be sharded; replicated over {self.axis!r}, grads all-reduced",
            )
        size = self.mesh.shape[index]
        dim = _free_dim(entry)
        rows = entry.shape[dim]
        uneven = (
            f", uneven: {rows} over {size} ranks, padded to {-(-rows // size)} per rank"
            if rows % size
            else ""
        )
        if self.shard != "params":
            return self._zero(entry, index, dim, uneven)
        kept = "" if self.reshard_after_forward else ", kept from the forward to the backward"
        early = " (issued while the block before it runs)" if self.prefetch else ""
        entry = entry.with_axis(
            index,
            storage=Shard(dim),
            compute=Replicate(),
            grad=average,
            reason=(
                f"{self}: dim {dim} sharded over {self.axis!r}{uneven}; gathered while its "
                f"block runs{early}{kept}, grads reduce-scattered (mean)"
            ),
        )
        return entry.annotate(Schedule(regather=self.reshard_after_forward, prefetch=self.prefetch))

    def _zero(self, entry: ParamPlan, index: int, dim: int, uneven: str) -> ParamPlan:
        """ZeRO-1/2: stored and used whole over the axis, optimizer state (and for ZeRO-2
        the grad) kept ``Shard(dim)``."""
        grads = "reduce-scattered (mean)" if self.shard == "grads" else "all-reduced (mean)"
        entry = entry.with_axis(
            index,
            storage=Replicate(),
            compute=Replicate(),
            grad=Partial("avg"),
            reason=(
                f"{self}: whole over {self.axis!r}; optimizer state dim {dim} sharded{uneven}, "
                f"grads {grads}, the update runs on the shard and is all-gathered once per step"
            ),
        )
        state = with_placement(entry.state_kept, index, Shard(dim))
        grad_kept = state if self.shard == "grads" else entry.grad_kept
        stage = ZeroStage(2 if self.shard == "grads" else 1)
        return replace(entry, state=state, grad_storage=grad_kept).annotate(stage)


def _free_dim(entry: ParamPlan) -> int:
    """The first dim no other mesh axis shards (tensor parallelism may hold dim 0), else 0."""
    taken = {p.dim for p in entry.storage if isinstance(p, Shard)}
    return next((d for d in range(len(entry.shape)) if d not in taken), 0)


def shard_params(
    mesh: DeviceMesh,
    axis: str | None = "fsdp",
    replicate_axis: str | None = None,
    *,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    microbatches: int = 1,
    prefetch: bool = True,
    shard: Sharded = "params",
    opt_state_device: str | None = None,
) -> ShardParams:
    """Shard params, grads and optimizer state over a mesh axis (FSDP / ZeRO-3), or only
    grads and optimizer state (ZeRO-2), or only optimizer state (ZeRO-1).

    Each param is stored ``Shard(dim)`` over ``axis`` (its first dim that ``tensor_parallel``
    does not already shard) and gathered just in time: a block's params
    when that block (a child of an ``nn.ModuleList``, e.g. ``layers.3``) starts, the others when
    the model is applied. With ``reshard_after_forward`` the gathered copies are dropped after
    the forward and gathered again for the backward, so a rank holds only its shards plus the
    block at work. Gradients are reduce-scattered back to the shards. With ``replicate_axis``
    as well, the shards are also replicated over that axis and their grads all-reduced across
    it (HSDP); with only ``replicate_axis`` (``axis=None``) params are replicated (DDP). Every
    data-parallel rank passes its own batch; losses and grads are means over all of them.

    Mixed precision: with ``param_dtype=torch.bfloat16`` the stored params (and optimizer)
    stay in their dtype (fp32 master weights) while blocks gather and compute in bf16; with
    ``reduce_dtype=torch.float32`` grads are reduced in fp32. With ``microbatches=k``,
    ``d9d.value_and_grad`` inside the step runs the loss on ``k`` equal slices of its batch
    arguments and reduces the summed grads once per step.

    With ``prefetch`` (eager), each block's all-gather is issued while the block before it
    computes, and in the backward while the block after it computes, so communication overlaps
    compute as in FSDP2; the same bytes move, and at most one block beyond the running one is
    gathered. Under :func:`d9d.jit` the compiler schedules the collectives.

    ZeRO-1/2 (``shard="opt_state"`` / ``"grads"``): params are stored whole over ``axis``
    (blocks use them with no all-gather) and the optimizer state is sharded ``Shard(dim)``
    (the dim ZeRO-3 would shard). Grads are reduce-scattered to shards (ZeRO-2) or
    all-reduced and sliced (ZeRO-1). The step body sees each param as this rank's shard
    of it (a view of the stored param, but for a param whose only dim ``tensor_parallel``
    shards: one all-gather over tp), so the unchanged ``grads -> opt.update ->
    apply_updates`` updates only the shard, with grads and state of the same shape; when the
    body returns, the updated shards are all-gathered into whole params, one all-gather per
    mesh axis and dtype for the whole model. Global grad norms (``clip_by_global_norm``) are
    over the whole grads, as with ZeRO-3. Under :func:`d9d.jit` all of it is one graph.
    Under :func:`d9d.pipeline` each stage computes with its whole stored params for every
    microbatch and reduces the grads they accumulate once per step (one reduce-scatter, or
    for ZeRO-1 one all-reduce, for the rank's stages). ``reshard_after_forward`` and
    ``prefetch`` are ZeRO-3's.

    Optimizer state on the host (``opt_state_device="cpu"``, with any ``shard``): ``place``
    keeps each state leaf laid out as above but in host memory (pinned when the mesh is on
    an accelerator); wrap the optimizer's elementwise part in :func:`d9d.optim.offloaded`,
    which copies each step's grad shards there, updates on the host and copies the updates
    back: ``chain(clip_by_global_norm(1.0), offloaded(adamw(...)))``. ``step.memory``
    counts the state apart (``host_opt_state``). Eager only; under ``pipeline`` each rank
    keeps its stages' state there.

    Args:
        mesh: The mesh, from :func:`d9d.make_mesh`.
        axis: The mesh axis to shard over, or None for DDP. Default ``"fsdp"``.
        replicate_axis: A mesh axis to replicate over (``"dp"``), or None.
        reshard_after_forward: Drop gathered params after the forward and gather them again
            for the backward (less memory, more traffic). Default True.
        param_dtype: dtype blocks gather and compute in (None: the params' own).
        reduce_dtype: dtype grads are reduced in (None: the params' own).
        microbatches: Gradient-accumulation microbatches per step (>= 1).
        prefetch: Issue the next block's all-gather before the current block computes
            (forward and backward). Default True.
        shard: What is sharded over ``axis`` besides the optimizer state: ``"params"``
            (and grads: ZeRO-3, FSDP), ``"grads"`` (ZeRO-2) or ``"opt_state"`` (nothing
            else: ZeRO-1). Default ``"params"``.
        opt_state_device: ``"cpu"``: keep the optimizer state in host memory and update
            there (:func:`d9d.optim.offloaded`); None (default): on the mesh's device.

    Returns:
        The transform: decorate a step with it.

    Raises:
        PlanError: An axis is not on the mesh, both axes are the same, or neither is given;
            ``microbatches`` is not a positive int or ``prefetch`` not a bool; ``shard`` is
            not one of the three, or is ZeRO-1/2 without ``axis`` or with
            ``reshard_after_forward`` or ``prefetch`` not True; ``opt_state_device`` is not
            None or ``"cpu"``.

    Example:
        >>> import d9d, torch
        >>> from d9d.testing import run_on_ranks
        >>> def rank_fn():
        ...     mesh = d9d.make_mesh("cpu", fsdp=2)
        ...     step = shard_params(mesh)(lambda p, s, b: (p, s, {}))
        ...     params, _ = step.place({"w": torch.ones(4, 3)}, ())
        ...     return params["w"].to_local().shape
        >>> run_on_ranks(rank_fn, 2)
        [torch.Size([2, 3]), torch.Size([2, 3])]
    """
    return ShardParams(
        mesh,
        axis,
        replicate_axis,
        reshard_after_forward,
        param_dtype,
        reduce_dtype,
        microbatches,
        prefetch,
        shard,
        opt_state_device,
    )
