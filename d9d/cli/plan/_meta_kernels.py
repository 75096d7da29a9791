"""Meta kernels answered from a cache of their earlier calls, for ``d9d plan``'s dry run.

A meta kernel only computes its outputs' shapes, strides and dtypes from its inputs', but
PyTorch writes many of them in Python (the elementwise references: about 100 µs an op), and
a dry run calls the same op on the same shapes again and again: every block alike, every
microbatch alike. Most of a pipelined DeepSeek-V3 plan was spent there (docs/plan.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MetaKernelCache"]

_META = torch.device("meta")


class MetaKernelCache(TorchDispatchMode):
    """Answers an ``aten`` op on meta tensors with new meta tensors of the outputs' shapes,
    strides and dtypes its kernel gave for the same inputs before (the same shapes, strides,
    offsets, dtypes and other arguments). Only for ops that neither write into nor return a
    view of an input (their schema says so), whose outputs are fresh meta tensors with the
    storage an empty tensor of their strides has (what ``KeptBytes`` counts); any other op
    runs its kernel.

    Enter it before the modes that must see every op (counters): it answers below them.
    ``calls`` counts the ops it saw, ``hits`` those it answered from the cache, ``kernels``
    the distinct calls it could answer and ran the kernel of (once each)."""

    def __init__(self) -> None:
        super().__init__()
        # {op and inputs: (several outputs, each output's (shape, stride, dtype)) or None}
        self._outputs: dict[Any, tuple[bool, list[tuple[Any, ...]]] | None] = {}
        self._plain: dict[Any, bool] = {}
        self.calls = 0
        self.hits = 0
        self.kernels = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.calls += 1
        key = _key(func, args, kwargs) if self._is_plain(func) else None
        if key is None:
            return func(*args, **kwargs)
        if key not in self._outputs:
            self.kernels += 1
            out = func(*args, **kwargs)
            self._outputs[key] = _described(out)
            return out
        known = self._outputs[key]
        if known is None:  # seen, and its outputs cannot be rebuilt
            return func(*args, **kwargs)
        self.hits += 1
        several, specs = known
        outs = [torch.empty_strided(s, st, dtype=d, device=_META) for s, st, d in specs]
        return tuple(outs) if several else outs[0]

    def _is_plain(self, func: Any) -> bool:
        """Whether ``func`` is an ``aten`` op that writes no input and returns no view."""
        plain = self._plain.get(func)
        if plain is None:
            schema = func._schema
            plain = (
                func.namespace == "aten"
                and not schema.is_mutable
                and all(r.alias_info is None for r in schema.returns)
                and all(str(r.type) == "Tensor" for r in schema.returns)
                and len(schema.returns) > 0
            )
            self._plain[func] = plain
        return plain


def _key(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """What a meta kernel's outputs depend on, hashable; None if an argument is a tensor not
    on meta (or a subclass) or a value that does not hash."""
    try:
        parts = [func, *(_arg(a) for a in args)]
        parts += [(k, _arg(v)) for k, v in kwargs.items()]
        key = tuple(parts)
        hash(key)
    except (_Unkeyed, TypeError):
        return None
    return key


class _Unkeyed(Exception):
    """An argument the cache does not key: a tensor not on meta, or a subclass."""


def _arg(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor or not value.is_meta:
            raise _Unkeyed
        return ("T", value.shape, value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, list | tuple):
        return (type(value).__name__, *(_arg(v) for v in value))
    return (type(value).__name__, value)


def _described(out: Any) -> tuple[bool, list[tuple[Any, ...]]] | None:
    """``(several outputs, each one's (shape, stride, dtype))``; None if one is not a fresh
    meta tensor with an empty tensor's storage."""
    several = isinstance(out, tuple | list)
    specs = []
    for t in out if several else (out,):
        if type(t) is not torch.Tensor or not t.is_meta or t.storage_offset() != 0:
            return None
        fresh = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_META)
        if fresh.untyped_storage().nbytes() != t.untyped_storage().nbytes():
            return None
        specs.append((tuple(t.shape), t.stride(), t.dtype))
    return several, specs
