"""Token ids checked against the embedding they index, in eager steps of every layout.

[Note: one check per lookup] ``d9d.jit`` checks each compiled lookup in its graph
(``_index_checks``). Eager code checks each ``nn.Embedding``'s ids before its lookup:
``Model.apply`` hooks the embeddings that see their whole table (one device, ``shard_params``,
``context_parallel``, a pipeline stage), and a transform that splits the table checks the
global ids before it masks the ones outside its rows (``tensor_parallel``: each rank would
otherwise turn an id past the vocab into a zero vector, silently). The error names the input
the ids come from as the jitted step does: ``d9d.value_and_grad`` records its arguments under
the names of ``fn``'s parameters (``batch['tokens']`` for ``loss_fn(params, batch)``), and ids
that are those tensors, or dim-0 slices of them (microbatches), take their name.

Each eager check is one ``aminmax`` over the ids and one read of two integers back to the
host: on an accelerator, a sync per embedding per forward.

An ``nn.Embedding`` subclass whose own ``forward`` takes something else than the ids (the
learned positions of OPT and BioGPT take the attention mask, BART's and its kin's the tokens,
whose shape they read, and look up positions they compute) has its ids checked where its table
is read: a torch function mode, active during that module's forward only, checks the index of
each ``F.embedding`` of its weight (before: its first argument, a float mask or token ids past
its 66 rows, was refused on one device).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode

from ._index_checks import raise_outside

__all__ = ["checked_ids", "embedding_checks", "looks_up_its_input", "named_inputs"]


class _Inputs(threading.local):
    def __init__(self) -> None:
        self.named: tuple[tuple[str, torch.Tensor], ...] = ()


_inputs = _Inputs()


@contextmanager
def named_inputs(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[None]:
    """While the block runs, the tensors in ``args``/``kwargs`` (the inputs of
    ``fn(params, *args, **kwargs)``) are known by the names of ``fn``'s parameters."""
    if torch.compiler.is_compiling():  # the compiled graph names its inputs itself
        yield
        return
    try:
        names = list(inspect.signature(fn).parameters)[1:]
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        names = []
    named: list[tuple[str, torch.Tensor]] = []
    for i, arg in enumerate(args):
        _collect(names[i] if i < len(names) else f"args[{i}]", arg, named)
    for name, arg in kwargs.items():
        _collect(name, arg, named)
    previous = _inputs.named
    _inputs.named = previous + tuple(named)
    try:
        yield
    finally:
        _inputs.named = previous


def checked_ids(ids: torch.Tensor, size: int, path: str) -> torch.Tensor:
    """``ids`` after checking that they index an embedding of ``size`` rows at ``path``.

    Eager: raises :class:`~d9d.errors.IndexRangeError` now, naming the input ``ids`` come from.
    Compiled: returns them through ``d9d::check_index``, which ``d9d.jit``'s graph pass names.
    Ids that are not integers (float tokens) raise ``TypeError`` in both, naming the input.
    """
    what = f"the index of embedding {path!r} over {size} entries,"
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        named = _name_of(ids)
        raise TypeError(
            f"{named[0] + ', ' if named else ''}{what} holds {ids.dtype} values, not ids; pass "
            "token ids as an integer tensor (e.g. tokens.long())"
        )
    if torch.compiler.is_compiling():
        return torch.ops.d9d.check_index(ids, size, what)
    if ids.is_meta or is_fake(ids):  # a dry run (d9d plan): no values to check
        return ids
    named = _name_of(ids)
    if named is None:
        raise_outside(ids, size, what)
    else:
        raise_outside(ids, size, f"{named[0]}, {what}", first_row=named[1])
    return ids


@contextmanager
def embedding_checks(modules: Mapping[str, nn.Module]) -> Iterator[None]:
    """While the block runs eagerly, each ``nn.Embedding`` in ``modules`` (``{path: module}``)
    checks its ids before its lookup, when it holds its whole table (a transform that splits
    the table checks the ids itself)."""
    if torch.compiler.is_compiling():  # ``d9d.jit`` checks the lookups in its graph
        yield
        return
    handles = []
    for path, module in modules.items():
        if not isinstance(module, nn.Embedding):
            continue
        if looks_up_its_input(module):
            handles.append(module.register_forward_pre_hook(_check_hook(path)))
            continue
        lookups = _LookupChecks(module, path)
        handles.append(module.register_forward_pre_hook(lookups.enter))
        handles.append(module.register_forward_hook(lookups.exit, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _check_hook(path: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
    def check(module: nn.Module, args: tuple[Any, ...]) -> None:
        ids = args[0] if args else None
        if isinstance(ids, torch.Tensor) and module.weight.shape[0] == module.num_embeddings:
            checked_ids(ids, module.num_embeddings, path)

    return check


def looks_up_its_input(module: nn.Embedding) -> bool:
    """Whether ``module``'s forward is ``nn.Embedding``'s: the lookup of its first argument."""
    return type(module).forward is nn.Embedding.forward


class _LookupChecks(TorchFunctionMode):
    """Checks the ids of each lookup of ``module``'s table while its own ``forward`` runs
    (entered by a forward pre-hook, left by a forward hook that runs on errors too), for an
    ``nn.Embedding`` subclass whose forward computes the ids from what it is given."""

    def __init__(self, module: nn.Embedding, path: str) -> None:
        super().__init__()
        self.module, self.path = module, path

    def enter(self, module: nn.Module, args: Any) -> None:
        self.__enter__()

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.__exit__(None, None, None)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is nn.functional.embedding:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            ids = args[0] if args else kwargs.get("input")
            module = self.module
            whole = module.weight.shape[0] == module.num_embeddings
            if weight is module.weight and whole and isinstance(ids, torch.Tensor):
                checked_ids(ids, module.num_embeddings, self.path)
        return func(*args, **kwargs)


def _collect(name: str, value: Any, out: list[tuple[str, torch.Tensor]]) -> None:
    """``(name['key'][0]..., tensor)`` of each tensor in ``value`` (float ones too: ids that
    are floats are named in their error)."""
    if isinstance(value, torch.Tensor):
        out.append((name, value))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _collect(f"{name}[{key!r}]", item, out)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _collect(f"{name}[{i}]", item, out)


def _name_of(ids: torch.Tensor) -> tuple[str, int] | None:
    """The name of the input ``ids`` are, or are rows of, and the first of those rows."""
    for name, tensor in _inputs.named:
        if ids is tensor:
            return name, 0
        first = _first_row_in(ids, tensor)
        if first is not None:
            return name, first
    return None


def _first_row_in(part: torch.Tensor, whole: torch.Tensor) -> int | None:
    """Where ``part`` starts in ``whole`` if it is a run of its dim-0 rows (a microbatch)."""
    if (
        part.ndim != whole.ndim
        or not part.ndim
        or part.shape[1:] != whole.shape[1:]
        or part.stride() != whole.stride()
        or part.dtype != whole.dtype
        or part.device != whole.device
        or part.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
    ):
        return None
    offset, row = part.storage_offset() - whole.storage_offset(), whole.stride(0)
    first, within = divmod(offset, row) if row else (0, offset)
    fits = not within and first >= 0 and first + part.shape[0] <= whole.shape[0]
    return first if fits else None
