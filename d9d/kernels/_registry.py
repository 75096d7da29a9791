"""Which backend runs a kernel op: the registry, its selection rule and its overrides.

An op (``"rms_norm"``) has a pure-PyTorch ``reference`` backend and any number of others
(``"triton"``, ...), tried in registration order. A call runs the first of these to apply:

1. the ``backend="..."`` argument of the call;
2. the innermost ``with d9d.kernels.use(op="...")`` block (a ContextVar, so threads and
   async tasks do not see each other's blocks);
3. the ``D9D_KERNELS`` environment variable, e.g. ``D9D_KERNELS="rms_norm=triton,swiglu=auto"``;
4. automatic: the first backend, in registration order, that runs on the tensors' device and
   dtype, implements the call's mode (an fp8 op's recipe), and whose ``auto`` rule accepts the
   device (Triton is picked automatically on CUDA only: on CPU it runs under
   ``TRITON_INTERPRET=1``, a test tool, and must be forced).

A backend forced by 1 to 3 that cannot run here raises :class:`KernelUnavailableError` saying
why; it never falls back silently. ``"auto"`` in 1 to 3 means step 4. Under ``torch.compile``
the choice is made once, when the function is traced, and baked into the graph.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import KernelUnavailableError, UnknownKernelError

__all__ = ["available", "register_backend", "resolve", "use"]

AUTO = "auto"
ENV_VAR = "D9D_KERNELS"
_UNKNOWN, _UNAVAILABLE = "unknown", "unavailable"  # error kinds of _resolve
FLOAT_DTYPES = frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16})


@dataclass(frozen=True)
class Backend:
    """One implementation of an op."""

    name: str
    impl: Callable[..., Any]
    dtypes: frozenset[torch.dtype]  # dtypes of the op's main tensor it accepts
    unavailable: Callable[[str | None], str | None]  # device type (None: any) -> why not, or None
    auto: Callable[[str], bool]  # device type -> may automatic selection pick it there
    # The op's modes it implements (fp8 recipes), None: all, or a function of the device type
    # giving them. A call names its mode, a string.
    variants: frozenset[str] | Callable[[str], Collection[str]] | None = None


@dataclass
class _Op:
    name: str
    backends: dict[str, Backend] = field(default_factory=dict)  # in priority order


_OPS: dict[str, _Op] = {}
_OVERRIDES: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "d9d_kernels_overrides", default=None
)


def _runs_anywhere(device_type: str | None) -> str | None:
    return None


def _auto_anywhere(device_type: str) -> bool:
    return True


def define_op(
    name: str, reference: Callable[..., Any], *, dtypes: frozenset[torch.dtype] = FLOAT_DTYPES
) -> None:
    """Declares op ``name`` with its pure-PyTorch ``reference`` backend (library-internal);
    ``dtypes``: those of the op's main tensor the reference accepts."""
    _OPS[name] = _Op(name)
    register_backend(name, "reference", reference, dtypes=dtypes, last=True)


def register_backend(
    op: str,
    name: str,
    impl: Callable[..., Any],
    *,
    dtypes: frozenset[torch.dtype] | set[torch.dtype],
    unavailable: Callable[[str | None], str | None] = _runs_anywhere,
    auto: Callable[[str], bool] = _auto_anywhere,
    variants: Collection[str] | Callable[[str], Collection[str]] | None = None,
    last: bool = False,
) -> None:
    """Adds backend ``name`` to ``op``, tried before the ones already there unless ``last``.

    ``impl`` takes the op's arguments exactly as the public function documents them (already
    validated) and must be traceable by ``torch.compile`` with no graph break: wrap device
    code in a ``torch.library.custom_op`` with a fake implementation and an autograd formula.

    Args:
        op: name of an op of ``d9d.kernels``, e.g. ``"rms_norm"``.
        name: backend name, e.g. ``"triton"``; ``"auto"`` is reserved.
        impl: the implementation.
        dtypes: dtypes of the op's main tensor (``x``, ``logits``, ``hidden``...) it accepts.
        unavailable: ``device_type -> reason or None``: why it cannot run on that device type
            here (``None`` as device type: on any device of this machine). Default: never.
        auto: ``device_type -> bool``: whether automatic selection may pick it there.
        variants: the modes of an op that has them (the fp8 ops' recipes) it implements, or
            ``device_type -> modes`` where they differ by device; None: all. Automatic
            selection skips a backend without the call's mode.
        last: add it after the existing backends instead of before.

    Raises:
        UnknownKernelError: ``op`` is not an op, or ``name`` is ``"auto"``.

    Example:
        >>> import d9d.kernels as K
        >>> K.register_backend("swiglu", "mine", lambda g, u: torch.nn.functional.silu(g) * u,
        ...                    dtypes={torch.float32}, auto=lambda device_type: False)
        >>> K.swiglu(torch.ones(2), torch.ones(2), backend="mine")
        tensor([0.7311, 0.7311])
    """
    if op not in _OPS:
        raise UnknownKernelError(f"cannot register a backend for {op=}: ops are {sorted(_OPS)}")
    if name == AUTO:
        raise UnknownKernelError(f"backend {name=} is reserved for automatic selection")
    modes = variants if variants is None or callable(variants) else frozenset(variants)
    backend = Backend(name, impl, frozenset(dtypes), unavailable, auto, modes)
    old = {k: v for k, v in _OPS[op].backends.items() if k != name}
    _OPS[op].backends = {**old, name: backend} if last else {name: backend, **old}
    _parse_env.cache_clear()


def _check_names(mapping: Mapping[str, str], source: str) -> None:
    for op, name in mapping.items():
        if op not in _OPS:
            raise UnknownKernelError(f"{source} names unknown op {op!r}: ops are {sorted(_OPS)}")
        known = list(_OPS[op].backends)
        if name != AUTO and name not in known:
            raise UnknownKernelError(
                f"{source} names unknown backend {name!r} for op {op!r}: "
                f"backends are {[*known, AUTO]}"
            )


@functools.lru_cache(maxsize=8)
def _parse_env(value: str) -> dict[str, str]:
    mapping = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        op, sep, name = item.partition("=")
        if not sep or not op.strip() or not name.strip():
            raise UnknownKernelError(
                f"{ENV_VAR}={value!r}: entry {item!r} is not 'op=backend', "
                f"e.g. {ENV_VAR}='rms_norm=triton,swiglu=reference'"
            )
        mapping[op.strip()] = name.strip()
    _check_names(mapping, f"{ENV_VAR}={value!r}")
    return mapping


@contextlib.contextmanager
def use(**choices: str) -> Iterator[None]:
    """Forces the backend of some ops inside a ``with`` block (``"auto"``: automatic).

    Blocks nest (the innermost wins per op) and are scoped to the current thread or async
    task. A ``backend=`` argument of a call still wins. Enter the block around a compiled
    function's first call, not inside it: the choice is baked in when it is traced.

    Args:
        **choices: op name -> backend name, e.g. ``rms_norm="reference"``.

    Raises:
        UnknownKernelError: an op or backend name is not registered.

    Example:
        >>> import d9d.kernels as K
        >>> with K.use(rms_norm="reference"):
        ...     y = K.rms_norm(torch.ones(2, 4), torch.ones(4))
        >>> y.shape
        torch.Size([2, 4])
    """
    _check_names(choices, f"d9d.kernels.use({', '.join(f'{k}={v!r}' for k, v in choices.items())})")
    token = _OVERRIDES.set({**(_OVERRIDES.get() or {}), **choices})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def _why_not(
    backend: Backend, device_type: str, dtype: torch.dtype, variant: str | None
) -> str | None:
    if dtype not in backend.dtypes:
        allowed = ", ".join(sorted(str(d).removeprefix("torch.") for d in backend.dtypes))
        return f"it supports dtypes {allowed}, got {dtype}"
    modes = backend.variants
    modes = modes(device_type) if callable(modes) else modes
    if variant is not None and modes is not None and variant not in modes:
        return f"it implements {sorted(modes)}, not {variant!r}"
    return backend.unavailable(device_type)


@torch.compiler.assume_constant_result
def _resolve(
    op: str, device_type: str, dtype: torch.dtype, requested: str | None, variant: str | None
) -> tuple:
    """``(backend, "", "")`` or ``("", error kind, message)``; constant under torch.compile."""
    try:
        env = _parse_env(os.environ.get(ENV_VAR, ""))
    except UnknownKernelError as error:
        return "", _UNKNOWN, str(error)
    known = _OPS[op].backends
    block = (_OVERRIDES.get() or {}).get(op)
    sources = [
        (requested, f"backend={requested!r}"),
        (block, f"d9d.kernels.use({op}={block!r})"),
        (env.get(op), f"{ENV_VAR}={os.environ.get(ENV_VAR, '')!r}"),
    ]
    for name, source in sources:
        if name is None:
            continue
        if name == AUTO:
            break
        if name not in known:
            return (
                "",
                _UNKNOWN,
                (f"{source}: op {op!r} has no backend {name!r}; backends are {[*known, AUTO]}"),
            )
        reason = _why_not(known[name], device_type, dtype, variant)
        if reason is not None:
            return (
                "",
                _UNAVAILABLE,
                (
                    f"{source}: backend {name!r} of op {op!r} cannot run on {device_type} tensors "
                    f"of dtype {dtype} here: {reason}. Use backend='auto' or one of "
                    f"{[n for n, b in known.items() if _why_not(b, device_type, dtype, variant) is None]}"
                ),
            )
        return name, "", ""
    for name, backend in known.items():
        if backend.auto(device_type) and _why_not(backend, device_type, dtype, variant) is None:
            return name, "", ""
    return (
        "",
        _UNAVAILABLE,
        f"no backend of op {op!r} runs on {device_type} tensors of dtype {dtype}"
        + ("" if variant is None else f" for {variant!r}"),
    )


def resolve(
    op: str, tensor: torch.Tensor, requested: str | None, variant: str | None = None
) -> Callable[..., Any]:
    """The implementation of ``op`` that runs on ``tensor``'s device and dtype (see module doc),
    and implements the call's mode ``variant`` (an fp8 recipe) if the op has modes.

    Raises:
        UnknownKernelError: a backend or op name is not registered.
        KernelUnavailableError: the forced backend cannot run here.
    """
    name, kind, message = _resolve(op, tensor.device.type, tensor.dtype, requested, variant)
    if kind == _UNKNOWN:
        raise UnknownKernelError(message)
    if kind == _UNAVAILABLE:
        raise KernelUnavailableError(message)
    return _OPS[op].backends[name].impl


def available() -> dict[str, dict[str, str | None]]:
    """Every op and backend, and why a backend cannot run on this machine.

    Returns:
        ``{op: {backend: None if it can run here, else the reason}}``, backends in the
        order automatic selection tries them.

    Example:
        >>> import d9d.kernels as K
        >>> K.available()["rms_norm"]["reference"] is None
        True
    """
    return {
        op: {name: backend.unavailable(None) for name, backend in entry.backends.items()}
        for op, entry in sorted(_OPS.items())
    }
