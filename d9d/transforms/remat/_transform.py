"""``remat``: activation checkpointing of the model's blocks, as a transform."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from torch.distributed.device_mesh import DeviceMesh

from ...core._param_plan import ParamPlan
from ...core._phase import Phase
from ...core._plan import Plan
from ...core._transform import Transform
from ...errors import PlanError
from ._policies import POLICIES
from ._runtime import RematRuntime

if TYPE_CHECKING:
    from ...core._model import Model

__all__ = ["Remat", "remat"]


@dataclass(frozen=True)
class Remat(Transform):
    """The ``remat`` transform; build it with :func:`remat`."""

    name: ClassVar[str] = "remat"
    phase: ClassVar[Phase] = Phase.RECOMPUTATION
    mesh: DeviceMesh | None = None
    policy: str = "full"
    every: int = 1

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise PlanError(f"remat(policy={self.policy!r}) is not a policy; use one of {POLICIES}")
        if not isinstance(self.every, int) or self.every < 1:
            raise PlanError(f"remat needs every >= 1, got every={self.every!r}")

    def __str__(self) -> str:
        return f"remat(policy={self.policy!r}, every={self.every})"

    def claimed_axes(self) -> tuple[str, ...]:
        return ()

    def rewrite(self, entry: ParamPlan) -> ParamPlan:
        return entry

    def runtime(self, plan: Plan, model: Model | None) -> RematRuntime:
        del plan, model
        return RematRuntime(self.policy, self.every)


def remat(policy: str = "full", *, every: int = 1, mesh: DeviceMesh | None = None) -> Remat:
    """Recompute the model's blocks in the backward instead of keeping their activations.

    Each chosen block (a child of the model's ``nn.ModuleList``) runs under
    ``torch.utils.checkpoint``: with ``policy="full"`` only its inputs are kept and its whole
    forward runs again in the backward; with ``"selective"`` the outputs of its matmuls,
    attention, reduce-scatters and all-to-alls (``expert_parallel``'s dispatch and combine)
    are kept too and only the rest (elementwise ops, norms, gathers) is recomputed. ``every=k`` checkpoints blocks ``0, k, 2k, ...``. Under
    ``shard_params`` a recomputed block gathers its params again, so no gathered param is
    kept for the backward; under ``tensor_parallel`` its collectives run again with it.
    Grads are those of the step without remat. Composes with every transform and with
    ``d9d.jit``, where the compiled graph recomputes the blocks (there ``"full"`` also keeps
    attention's outputs, which torch does not recompute; ``docs/decisions.md``); ``jit``
    refuses it with microbatch accumulation.

    Args:
        policy: ``"full"`` or ``"selective"``.
        every: Checkpoint every ``every``-th block (default all).
        mesh: The mesh, when no other transform of the step gives it; default: the other
            transforms' mesh, or on one device a one-rank mesh (``d9d.make_mesh(fsdp=1)``,
            which needs no ``torchrun``).

    Returns:
        The transform: decorate a step with it.

    Raises:
        PlanError: An unknown policy, or ``every < 1``.

    Example:
        >>> import d9d, torch
        >>> from d9d.models import Llama, LlamaConfig
        >>> from d9d.testing import run_on_ranks
        >>> def rank_fn():
        ...     mesh = d9d.make_mesh("cpu", fsdp=2)
        ...     model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=2)))
        ...     loss = d9d.value_and_grad(lambda p, t: model.apply(p, t).float().mean())
        ...     step = d9d.shard_params(mesh)(remat("full")(lambda p, s, t: (p, s, loss(p, t)[0])))
        ...     params, _ = step.place(model.params, ())
        ...     return step(params, (), torch.zeros(2, 8, dtype=torch.long))[2].shape
        >>> run_on_ranks(rank_fn, 2)
        [torch.Size([]), torch.Size([])]
    """
    return Remat(mesh, policy, every)
