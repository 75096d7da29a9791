"""One param's plan: how it is stored, computed and reduced, and why; pure data.

A transform's rule rewrites a :class:`ParamPlan`; the step gathers, reduces, places and
checks from it (``_gather``, ``_grad_reduce``, ``_placed_trees``), counts its memory from it (``_step``);
``_plan`` holds every param's plan and prints them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol, TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard

from ._structure import Axes

__all__ = ["Cast", "GatherCodec", "ParamPlan", "with_placement"]

_A = TypeVar("_A")


class GatherCodec(Protocol):
    """How a stored shard is all-gathered and computed with: :class:`Cast`'s members (see
    its docstring), which the core's gathers call without knowing the format."""

    statistic_op: ClassVar[str | None]

    @property
    def statistic_dim(self) -> int | None: ...

    @property
    def wire_dtype(self) -> torch.dtype: ...

    @property
    def compute_dtype(self) -> torch.dtype: ...

    @property
    def parts(self) -> int: ...

    def statistic(self, shard: torch.Tensor) -> torch.Tensor | None: ...

    def encode(
        self, shard: torch.Tensor, statistic: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def decode(
        self, gathered: torch.Tensor, statistic: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


@dataclass(frozen=True)
class Cast:
    """The gather codec that casts a stored shard to ``dtype`` before it is all-gathered
    (mixed precision: fp32 stored, bf16 gathered and computed with).

    A gather codec says how a stored shard becomes what is all-gathered (``encode``), and
    how the gathered buffer becomes the tensor blocks compute with (``decode``); params
    with equal codecs share one all-gather. ``wire_dtype`` is the dtype on the wire,
    ``compute_dtype`` the dtype of what ``decode`` returns (and of the grad that comes
    back to it). A codec with a ``statistic_op`` (``"max"``, ``"sum"``) first computes a
    small float32 ``statistic(shard)`` per param, which is all-reduced over the gathering
    ranks (once a step for all the step's params, as it starts: a step does not change the
    stored shards; a gather outside a step all-reduces those it gathers together) and
    passed to ``encode`` and ``decode``: a scale taken from the whole param's amax, for data in a
    narrower format (the fp8 package's codec). A cast has none.

    ``statistic_dim``: None, or a tensor dim ``d`` when the statistic holds one value per
    index of dim ``d`` (a stack of experts ``[E, K, N]`` scaled one per expert: ``d = 0``).
    The core then reduces each value with those of the same index on the other ranks:
    ``statistic(shard)`` gives the shard's indices of ``d``; where the gather runs along
    ``d`` the ranks hold different indices, so each rank's values are laid at its shard's
    offset (the op's identity elsewhere) before the all-reduce. ``decode`` takes the values
    of the gathered tensor's indices of ``d``, ``encode`` those of the shard's.

    ``parts`` is how many tensors ``decode`` returns: one, the tensor computed with; or a
    tuple of ``parts`` plain tensors, the first the one autograd differentiates (the
    compute dtype and the param's shape: its grad comes back to the gather) and the others
    carried beside it, not differentiated. The core's gathers return such a tuple as the
    compute value. The fp8 package's codec decodes into a tensor subclass in eager and into
    its plain parts under ``torch.compile``, which traces no subclass out of an autograd
    function (Dynamo traces its backward with grads of the outputs' type). A cast has one.
    """

    dtype: torch.dtype
    statistic_op: ClassVar[str | None] = None
    statistic_dim: ClassVar[int | None] = None

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype all-gathered."""
        return self.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype blocks compute with."""
        return self.dtype

    @property
    def parts(self) -> int:
        """How many tensors ``decode`` returns: the cast tensor alone."""
        return 1

    def statistic(self, shard: torch.Tensor) -> torch.Tensor | None:
        """What is all-reduced over the gathering ranks before encoding: none for a cast."""
        del shard
        return None

    def encode(self, shard: torch.Tensor, statistic: torch.Tensor | None = None) -> torch.Tensor:
        """What is all-gathered for ``shard``."""
        del statistic
        return shard.to(self.dtype)

    def decode(self, gathered: torch.Tensor, statistic: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor to compute with, from the gathered buffer."""
        del statistic
        return gathered


@dataclass(frozen=True)
class ParamPlan:
    """The layout of one param on the mesh: how it is stored, used, how its grad comes back
    and is kept, how its optimizer state is kept, and the transforms' own notes on it.

    Attributes:
        path: The param's path.
        shape: Its global shape.
        dtype: Its dtype.
        axes: Its logical axis names (``None`` when unknown).
        storage: Placement per mesh axis of the param as stored.
        compute: Placement per mesh axis while a block uses it.
        grad: Placement per mesh axis of the grad where it is computed (``Partial`` on the
            data-parallel axes: each rank holds the grad of its own batch).
        reasons: One line per transform that set a placement, for ``Plan.explain``.
        codec: How a stored shard becomes what is gathered and computed with (:class:`Cast`,
            or another object with its members: the fp8 package's data and scale), or None:
            as stored.
        reduce_dtype: The dtype its grad is reduced in (None: the param's own).
        grad_storage: Placement per mesh axis its grad is reduced to and kept in (None: as
            the param is stored).
        state: Placement per mesh axis of its optimizer state (None: as the param is stored).
        state_device: The device type its optimizer state is kept on (None: the mesh's).
        grad_scale: The factor its grad is multiplied by when it comes back (1: none).
        stage_copies: How many ranks of the plan's ``stage_group`` hold it (2 for a param
            tied between the first and the last stage on two ranks), 1 without one.
        annotations: Transforms' own per-param data, one object per kind (its type): the
            core carries them and reads none (:meth:`annotation`, :meth:`annotate`); one
            with a ``column`` name and a ``cell()`` is a column of the plan's table.
    """

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    axes: Axes | None
    storage: tuple[Placement, ...]
    compute: tuple[Placement, ...]
    grad: tuple[Placement, ...]
    reasons: tuple[str, ...] = ()
    codec: GatherCodec | None = None
    reduce_dtype: torch.dtype | None = None
    grad_storage: tuple[Placement, ...] | None = None
    state: tuple[Placement, ...] | None = None
    state_device: str | None = None
    grad_scale: float = 1.0
    stage_copies: int = 1
    annotations: tuple[Any, ...] = ()

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype blocks compute with (None: the param's own)."""
        return None if self.codec is None else self.codec.compute_dtype

    @property
    def grad_kept(self) -> tuple[Placement, ...]:
        """Placements of the reduced grad."""
        return self.storage if self.grad_storage is None else self.grad_storage

    @property
    def state_kept(self) -> tuple[Placement, ...]:
        """Placements of the optimizer state's leaves shaped like the param."""
        return self.storage if self.state is None else self.state

    def annotation(self, kind: type[_A]) -> _A | None:
        """The annotation of type ``kind``, or None."""
        return next((a for a in self.annotations if isinstance(a, kind)), None)

    def annotate(self, value: Any) -> ParamPlan:
        """A copy with ``value`` as its annotation of ``type(value)`` (replacing one)."""
        kept = tuple(a for a in self.annotations if type(a) is not type(value))
        return replace(self, annotations=(*kept, value))

    def with_axis(
        self, index: int, *, storage: Placement, compute: Placement, grad: Placement, reason: str
    ) -> ParamPlan:
        """A copy with mesh axis ``index`` set to the given placements and ``reason`` added."""
        return replace(
            self,
            storage=with_placement(self.storage, index, storage),
            compute=with_placement(self.compute, index, compute),
            grad=with_placement(self.grad, index, grad),
            reasons=(*self.reasons, reason),
        )

    def local_shape(
        self, mesh: DeviceMesh, placements: tuple[Placement, ...] | None = None
    ) -> tuple[int, ...]:
        """The largest local shape over ranks (a padded shard) for ``placements`` (storage)."""
        shape = list(self.shape)
        for size, placement in zip(mesh.shape, placements or self.storage, strict=True):
            if isinstance(placement, Shard):
                shape[placement.dim] = math.ceil(shape[placement.dim] / size)
        return tuple(shape)

    def bytes_per_rank(self, mesh: DeviceMesh) -> int:
        """Bytes of the largest stored shard on one rank."""
        return math.prod(self.local_shape(mesh)) * self.dtype.itemsize

    def padding_bytes(self, mesh: DeviceMesh) -> int:
        """Bytes all ranks together store beyond the param's size when shards are uneven."""
        copies = math.prod(
            size
            for size, p in zip(mesh.shape, self.storage, strict=True)
            if not isinstance(p, Shard)
        )
        total = math.prod(self.shape) * self.dtype.itemsize * copies
        return self.bytes_per_rank(mesh) * mesh.size() - total


def with_placement(
    placements: tuple[Placement, ...], index: int, value: Placement
) -> tuple[Placement, ...]:
    """``placements`` with mesh axis ``index``'s placement replaced by ``value``."""
    return (*placements[:index], value, *placements[index + 1 :])
