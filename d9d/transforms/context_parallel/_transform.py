"""``context_parallel``: each rank of the ``cp`` axis takes a slice of every sequence.

Params stay whole on ``cp``; each rank's grads come from its own tokens and are averaged over
the axis, as over a data-parallel axis. Before the step body runs the batch is cut along the
sequence (zigzag by default, so causal work is equal on every rank), ``Model.apply`` passes the
rank's global positions, and attention is ring attention (``_runtime.py`` beside this file).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate

from ...core._param_plan import ParamPlan
from ...core._phase import Phase
from ...core._plan import Plan
from ...core._transform import Transform
from ...parallel._zigzag import check_load_balance
from ._runtime import ContextParallelRuntime
from ._split import SequenceSplit

if TYPE_CHECKING:
    from ...core._model import Model

__all__ = ["ContextParallel", "context_parallel"]


@dataclass(frozen=True)
class ContextParallel(Transform):
    """The ``context_parallel`` transform; build it with :func:`context_parallel`."""

    name: ClassVar[str] = "context_parallel"
    phase: ClassVar[Phase] = Phase.COMPUTE_LAYOUT
    mesh: DeviceMesh
    axis: str = "cp"
    load_balance: str | None = "zigzag"

    def __post_init__(self) -> None:
        self._axis_index(self.axis, "axis")
        check_load_balance(self.load_balance)

    def __str__(self) -> str:
        return f"context_parallel(axis={self.axis!r})"

    def claimed_axes(self) -> tuple[str, ...]:
        return (self.axis,)

    def token_axes(self) -> tuple[str, ...]:
        return (self.axis,)

    def runtime(self, plan: Plan, model: Model | None) -> ContextParallelRuntime:
        del plan
        split = SequenceSplit(
            group_name=self.mesh.get_group(self.axis).group_name,
            axis=self.axis,
            rank=self._coordinate(self.axis),
            size=self.mesh.shape[self._axis_index(self.axis, "axis")],
            load_balance=self.load_balance,
        )
        runtime = ContextParallelRuntime(split)
        if model is not None:
            runtime.check_layers(model.structure)
        return runtime

    def rewrite(self, entry: ParamPlan) -> ParamPlan:
        return entry.with_axis(
            self._axis_index(self.axis, "axis"),
            storage=Replicate(),
            compute=Replicate(),
            grad=Partial("avg"),
            reason=(
                f"{self}: replicated over {self.axis!r}, each rank holding a slice of every "
                "sequence; grads all-reduced (mean)"
            ),
        )


def context_parallel(
    mesh: DeviceMesh, axis: str = "cp", *, load_balance: str | None = "zigzag"
) -> ContextParallel:
    """Split every sequence of the batch over a mesh axis; attention is ring attention.

    Each rank of ``axis`` passes the same batch; the step body sees this rank's part of every
    batch tensor of rank >= 2 (cut along dim 1, the sequence). With ``load_balance="zigzag"``
    the sequence is cut into ``2 * cp`` chunks and rank ``r`` takes chunks ``r`` and
    ``2 * cp - 1 - r``, so every rank does the same causal attention work; ``None`` cuts
    contiguous chunks. ``Model.apply`` passes the model the global positions of the rank's
    tokens (``positions=`` for the d9d Llama, ``position_ids=`` for a Hugging Face model), and
    attention runs as ring attention over the cp ranks (``docs/context_parallel.md``). Grads
    and metrics are averaged over the axis. Composes with ``tensor_parallel`` and
    ``shard_params``.

    Args:
        mesh: The mesh, from :func:`d9d.make_mesh`.
        axis: The mesh axis to split sequences over. Default ``"cp"``.
        load_balance: ``"zigzag"`` (default) or None.

    Returns:
        The transform: decorate a step with it.

    Raises:
        PlanError: ``axis`` is not on the mesh; a Hugging Face model whose layers mix
            positions outside attention, or whose attention ring attention does not implement
            (``docs/context_parallel.md``), at ``place(..., model=model)`` or its first step.
        ValueError: ``load_balance`` is neither ``"zigzag"`` nor None.

    Example:
        >>> import d9d, torch
        >>> from d9d.testing import run_on_ranks
        >>> def rank_fn():
        ...     mesh = d9d.make_mesh("cpu", cp=2)
        ...     seen = []
        ...     step = context_parallel(mesh)(lambda p, s, b: (p, s, seen.append(b.tolist())))
        ...     params, _ = step.place({"w": torch.ones(2)}, ())
        ...     step(params, (), torch.arange(8).view(1, 8))
        ...     return seen[0]
        >>> run_on_ranks(rank_fn, 2)  # zigzag: chunks 0 and 3, chunks 1 and 2
        [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    """
    return ContextParallel(mesh, axis, load_balance)
