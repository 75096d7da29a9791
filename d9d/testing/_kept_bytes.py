"""What a forward keeps for its backward: the bytes of op outputs still alive after it."""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .. import tree
from ..launch._exit import wait_for_collective_threads

__all__ = ["KeptBytes"]


class KeptBytes(TorchDispatchMode):
    """Within the block, records a weak reference to the storage of every tensor an op
    returns; :meth:`alive` then sums the bytes of those still alive (what autograd,
    ``torch.utils.checkpoint`` and the caller keep), each storage once however many views
    of it are alive.

    Storages are told apart by identity, not address, so meta tensors (a dry run: no data,
    real sizes) are measured like any. An op on DTensors is seen as the local ops DTensor
    runs, so a DTensor counts its local shard. :attr:`before_backward` is what was alive when
    the first op of a backward ran: around a whole training step, what its forward keeps for
    the backward (under a pipeline schedule, the microbatches in flight at that point).

    Args:
        exclude: A pytree of tensors whose storages are never counted (the params, the
            optimizer state, the batch: ops may return views of them). Default none.

    Example:
        >>> x = torch.ones(4, requires_grad=True)
        >>> with KeptBytes() as kept:
        ...     y = (x * 2).sin()
        ...     y.sum().backward()
        >>> kept.before_backward  # x * 2 (saved by sin), y: float32 [4]; the sum, its seed: []
        40
        >>> kept.alive()  # after the backward: y and x.grad
        32
    """

    def __init__(self, exclude: Any = ()) -> None:
        super().__init__()
        # {storage identity: (weak reference, bytes, data pointer)}
        self.outputs: dict[int, tuple[StorageWeakRef, int, int]] = {}
        self.excluded = {
            StorageWeakRef(_local(leaf).untyped_storage()).cdata
            for leaf in tree.leaves(exclude)
            if isinstance(leaf, torch.Tensor)
        }
        self.before_backward: int | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            # Modes run before subclasses: let DTensor lower the op to local ops, which then
            # come back here with the local shards.
            return NotImplemented
        if self.before_backward is None and torch._C._current_autograd_node() is not None:
            self.before_backward = self.alive()
        out = func(*args, **(kwargs or {}))
        for leaf in out if isinstance(out, tuple | list) else (out,):
            # A wrapper subclass (an async collective's result) has no storage of its own:
            # its wait returns the plain tensor that holds the bytes, recorded then.
            if type(leaf) is torch.Tensor:
                storage = leaf.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in self.excluded:
                    self.outputs[ref.cdata] = (ref, storage.nbytes(), storage.data_ptr())
        return out

    def alive(self, skip: set[int] = frozenset()) -> int:
        """Bytes of the recorded storages still alive, but those at addresses ``skip`` (e.g.
        params that ops returned views of). A storage that only a gloo worker thread still
        holds, its collective done, is let go first (the worker can lag the caller by
        milliseconds on a loaded machine: ``d9d/launch/_exit.py``)."""
        wait_for_collective_threads()
        gc.collect()
        return sum(
            size
            for ref, size, ptr in self.outputs.values()
            if not ref.expired() and not (ptr and ptr in skip)
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
