"""What a forward keeps for its backward: the bytes of op outputs still alive after it."""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KeptBytes"]


class KeptBytes(TorchDispatchMode):
    """Within the block, records a weak reference to the storage of every tensor an op
    returns; :meth:`alive` then sums the bytes of those still alive (what autograd,
    ``torch.utils.checkpoint`` and the caller keep).

    Example:
        >>> x = torch.ones(4, requires_grad=True)
        >>> with KeptBytes() as kept:
        ...     y = (x * 2).sin()
        >>> kept.alive()  # x * 2, saved by sin, and y: two float32 [4]
        32
    """

    def __init__(self) -> None:
        super().__init__()
        self.outputs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in out if isinstance(out, tuple | list) else (out,):
            # A wrapper subclass (an async collective's result) has no storage of its own:
            # its wait returns the plain tensor that holds the bytes, recorded then.
            if type(leaf) is torch.Tensor and leaf.device.type != "meta":
                storage = leaf.untyped_storage()
                self.outputs[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def alive(self, skip: set[int] = frozenset()) -> int:
        """Bytes of the recorded storages still alive, but those at addresses ``skip`` (e.g.
        params that ops returned views of)."""
        gc.collect()
        return sum(
            size
            for ptr, (ref, size) in self.outputs.items()
            if ptr not in skip and not ref.expired()
        )
