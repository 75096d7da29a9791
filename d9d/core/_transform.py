"""The transform protocol: a frozen object that claims mesh axes, rewrites each param's plan,
may lay the whole plan out anew, and may contribute a runtime to the step's execution.

Transforms apply phase by phase (:class:`~d9d.core._phase.Phase`, where the order is documented);
decorator order never matters.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from torch.distributed.device_mesh import DeviceMesh

from ..errors import PlanError
from ._mesh_hash import pin_hash
from ._param_plan import ParamPlan
from ._phase import Phase
from ._plan import Plan
from ._runtime import Runtime
from ._step import OutermostStep, TransformedStep

if TYPE_CHECKING:
    from ._model import Model

__all__ = ["Transform"]


class Transform(abc.ABC):
    """A rewrite of a step's param layout (and, through its runtime, of the step) on a mesh.

    Subclasses are frozen dataclasses with a ``mesh`` field.

    Attributes:
        name: The transform's name (``"shard_params"``), in messages; transforms of one
            phase apply in the order of their names.
        phase: When it applies (:class:`~d9d.core._phase.Phase`).
    """

    name: ClassVar[str]
    phase: ClassVar[Phase]
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

    def for_model(self, model: Model | None) -> Transform:
        """This transform as it plans the params of ``model`` (the one passed to
        ``step.place``, or None), for :meth:`rewrite` and :meth:`lay_out`: a rule that
        depends on what a param's module is, not on the param's plan alone, reads the
        model here, once per plan (default: itself)."""
        del model
        return self

    @abc.abstractmethod
    def rewrite(self, entry: ParamPlan) -> ParamPlan:
        """The param's plan after this transform."""

    def lay_out(self, plan: Plan, model: Model | None) -> Plan:
        """The whole plan after this transform, once every param is rewritten (default: as
        is). ``model`` is the one passed to ``step.place``, or None."""
        del model
        return plan

    def runtime(self, plan: Plan, model: Model | None) -> Runtime | None:
        """This transform's part in running the step on ``plan`` (default none)."""
        del plan, model
        return None

    def __call__(self, step: Callable[..., Any]) -> TransformedStep:
        if isinstance(step, OutermostStep):
            raise PlanError(step.refusal_of(self.name))
        if self.mesh is not None:  # a mesh not from make_mesh: see d9d/core/_mesh_hash.py
            pin_hash(self.mesh)
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

    def _coordinate(self, axis: str) -> int:
        """This rank's coordinate on ``axis``."""
        coordinate = self.mesh.get_coordinate()
        return coordinate[self._axis_index(axis, "axis")] if coordinate is not None else 0
