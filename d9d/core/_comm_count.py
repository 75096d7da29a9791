"""Counting the collectives a step issues: kind, mesh axis, count and bytes."""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .. import tree

__all__ = [
    "CollectiveCounter",
    "CommStats",
    "add_counts",
    "record_object_broadcast",
    "record_p2p",
    "recording_into",
]

_functional = torch.ops._c10d_functional

# Each op's bytes are the size of the full buffer it works on: the gathered output of an
# all-gather, the unreduced input of a reduce-scatter, the tensor of an all-reduce, the input
# of an all-to-all. Wire bytes per rank follow from these (e.g. (n - 1) / n of them in a ring).
_KINDS = {
    _functional.all_gather_into_tensor.default: "all_gather",
    _functional.reduce_scatter_tensor.default: "reduce_scatter",
    _functional.all_reduce.default: "all_reduce",
    _functional.all_to_all_single.default: "all_to_all",
    _functional.broadcast.default: "broadcast",
}

_c10d = torch.ops.c10d

# The same collectives issued through ``torch.distributed``'s in-place API (a pipeline's
# ``broadcast_object_list`` of the aux outputs): kind, and which argument holds the buffer.
_IN_PLACE = {
    _c10d.broadcast_.default: ("broadcast", 0),
    _c10d.allreduce_.default: ("all_reduce", 0),
    _c10d.allgather_.default: ("all_gather", 0),
    _c10d._allgather_base_.default: ("all_gather", 0),
    _c10d.reduce_scatter_.default: ("reduce_scatter", 1),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", 1),
    _c10d.alltoall_base_.default: ("all_to_all", 1),
}


@dataclass
class CommStats:
    """Collectives one step issued, per ``(kind, mesh axis)``: ``count`` and ``bytes``.

    Attributes:
        count: ``{(kind, axis): number of collectives}``.
        bytes: ``{(kind, axis): bytes of the buffers they worked on}``.
    """

    count: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))

    def total_bytes(self, kind: str | None = None, axis: str | None = None) -> int:
        """Bytes summed over the entries matching ``kind`` and ``axis`` (None matches all)."""
        return sum(b for (k, a), b in self.bytes.items() if kind in (None, k) and axis in (None, a))

    def total_count(self, kind: str | None = None, axis: str | None = None) -> int:
        """Collectives counted over the entries matching ``kind`` and ``axis``."""
        return sum(c for (k, a), c in self.count.items() if kind in (None, k) and axis in (None, a))

    def __str__(self) -> str:
        rows = [
            f"{kind:>14} on {axis:<6} {self.count[(kind, axis)]:>5} x  {self.bytes[(kind, axis)]:>14,} B"
            for kind, axis in sorted(self.count)
        ]
        return "\n".join(rows) if rows else "no collectives"


class _Counting(threading.local):
    def __init__(self) -> None:
        self.counter: CollectiveCounter | None = None
        self.into: tuple[CommStats | None] | None = None  # set by ``recording_into``


_counting = _Counting()


def _target() -> CommStats | None:
    """Where this thread's counts go now: the active counter's stats, or what
    :func:`recording_into` set; None: nowhere."""
    counter = _counting.counter
    if counter is None:
        return None
    return counter.stats if _counting.into is None else _counting.into[0]


@contextlib.contextmanager
def recording_into(stats: CommStats | None) -> Iterator[None]:
    """Within the block, what an active :class:`CollectiveCounter` counts on this thread
    goes to ``stats`` instead of its own stats (None: is not counted). For a pipeline dry
    run that counts one microbatch of a stage and scales it (``add_counts``)."""
    previous = _counting.into
    _counting.into = (stats,)
    try:
        yield
    finally:
        _counting.into = previous


def add_counts(stats: CommStats, times: int = 1) -> None:
    """Count ``stats`` ``times`` over, if a :class:`CollectiveCounter` is active."""
    target = _target()
    if target is not None:
        for key, n in stats.count.items():
            target.count[key] += times * n
        for key, n in stats.bytes.items():
            target.bytes[key] += times * n


def record_object_broadcast(obj: Any, axis: str) -> None:
    """Count the two broadcasts ``torch.distributed.broadcast_object_list([obj])`` makes on
    ``axis`` (the pickle's length, an int64, then the pickle), for a dry run that does not
    make them: ``obj``'s tensors as CPU tensors of their shapes, which pickle to the same
    length whatever their values."""
    on_cpu = tree.map(
        lambda x: torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x, obj
    )
    record_p2p("broadcast", axis, 8)
    record_p2p("broadcast", axis, len(pickle.dumps(on_cpu)))


def record_p2p(kind: str, axis: str, nbytes: int) -> None:
    """Count one point-to-point ``send`` or ``recv`` of ``nbytes`` on ``axis`` (pipeline
    stages), if a :class:`CollectiveCounter` is active on this thread."""
    target = _target()
    if target is not None:
        target.count[(kind, axis)] += 1
        target.bytes[(kind, axis)] += nbytes


class CollectiveCounter(TorchDispatchMode):
    """A dispatch mode that records every functional collective (what DTensor issues), and
    the point-to-point transfers of pipeline stages.

    Args:
        mesh: Names the axis of each collective from its process group.
        labels: Axis names of other process groups, by group name.

    Example:
        >>> with CollectiveCounter(mesh) as counter:  # doctest: +SKIP
        ...     step(params, opt_state, batch)
        >>> counter.stats.count  # doctest: +SKIP
    """

    def __init__(self, mesh: DeviceMesh, labels: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.stats = CommStats()
        self._axis_of = {
            mesh.get_group(name).group_name: name for name in mesh.mesh_dim_names or ()
        }
        self._axis_of.update(labels or {})
        self._outer: CollectiveCounter | None = None

    def __enter__(self) -> CollectiveCounter:
        self._outer, _counting.counter = _counting.counter, self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _counting.counter = self._outer
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            # Modes run before subclasses: let DTensor lower the op to local ops and the
            # collectives its placements need, which then come back here and are counted.
            return NotImplemented
        kind = _KINDS.get(func)
        if kind is not None or func in _IN_PLACE:
            if kind is not None:
                group = args[-1]
                size = _nbytes(args[0]) * (args[1] if kind == "all_gather" else 1)
            else:
                kind, index = _IN_PLACE[func]
                group = _group_name(args)
                size = _nbytes(args[index])
            axis = self._axis_of.get(group, str(group))
            target = self.stats if _counting.into is None else _counting.into[0]
            if target is not None:
                target.count[(kind, axis)] += 1
                target.bytes[(kind, axis)] += size
        return func(*args, **(kwargs or {}))


def _nbytes(buffers: Any) -> int:
    """Bytes of a tensor, or of the tensors of a (nested) list of them."""
    if isinstance(buffers, torch.Tensor):
        return buffers.numel() * buffers.element_size()
    return sum(_nbytes(b) for b in buffers)


def _group_name(args: Any) -> str:
    """The name of the process group an in-place ``c10d`` op gets among ``args``."""
    boxed = next(a for a in args if isinstance(a, torch.ScriptObject))
    return dist.ProcessGroup.unbox(boxed).group_name
