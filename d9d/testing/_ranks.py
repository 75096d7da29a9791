"""Run a function on several ranks of a real process group, from inside one test."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from typing import Any, Literal

import torch.distributed as dist

from ._outcome import results_or_raise
from ._process_ranks import run_processes
from ._thread_ranks import run_threads

__all__ = ["run_on_ranks"]

_METHODS = ("thread", "fork", "spawn")


def _validate(
    fn: Callable[..., Any],
    world_size: int,
    call: tuple[Any, ...],
    method: str,
    backend: str,
    timeout: float,
) -> None:
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be callable.")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"{world_size=} must be an int >= 1.")
    if method not in _METHODS:
        raise ValueError(f"{method=} is not one of {_METHODS}.")
    if not (isinstance(timeout, int | float) and 0 < timeout < math.inf):
        raise ValueError(f"{timeout=} must be a finite number of seconds > 0.")
    if method == "thread" and backend != "gloo":
        raise ValueError(
            f"{backend=} needs real processes: method='thread' runs an in-process group "
            "that stands in for gloo on CPU tensors; use method='fork' or 'spawn'."
        )
    if dist.is_initialized():
        raise RuntimeError(
            "run_on_ranks was called where a default process group is already initialised "
            f"(backend {dist.get_backend()!r}, world size {dist.get_world_size()}), e.g. inside "
            "another run_on_ranks rank or a fake_world block. Destroy it first, or call "
            "run_on_ranks from plain test code."
        )
    if method == "spawn":
        try:
            pickle.dumps(call)
        except Exception as exc:
            raise ValueError(
                f"method='spawn' sends fn and its arguments to fresh interpreters by pickle, "
                f"and they cannot be pickled ({exc}). Define fn at module level of an "
                "importable module (not a lambda or a nested function), or use "
                "method='fork' or 'thread'."
            ) from None


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    method: Literal["thread", "fork", "spawn"] = "thread",
    backend: str = "gloo",
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results.

    Each rank runs with an initialised default process group, reads its rank from
    ``torch.distributed.get_rank()``, and may build device meshes and DTensors. The group
    is destroyed when ``fn`` returns. Methods:

    - ``"thread"`` (the default, for tests): ranks are threads of this process over
      PyTorch's in-process threaded process group; collectives and DTensor ops on CPU
      meshes (2D ones included) work. Starting is nearly free. Threads share all torch
      global state: the RNG (``torch.manual_seed`` on one rank seeds all), default dtype,
      ``torch.distributed`` settings other than the group, environment variables.
      Results come back as the very objects ``fn`` returned. Once a rank fails, ranks
      waiting on a collective are stopped and reported as such, even if they would have
      failed too.
    - ``"fork"``: ranks are forked processes on ``backend`` (gloo), joined through a
      FileStore in a temporary folder. About as fast as threads, and each rank has its
      own process state. ``fn`` and its arguments are inherited, so closures work; the
      results must pickle, and come back as copies.
    - ``"spawn"``: like fork, but in fresh interpreters (about 2 s per rank on 2 CPU
      cores). ``fn`` and its arguments are pickled, so ``fn`` must be defined at module
      level of an importable module (it is pickled by reference).

    Process ranks run with one intra-op thread each (as under ``torchrun``). No method
    changes this process's environment variables or process group.

    Args:
        fn: The function each rank runs.
        world_size: Number of ranks (>= 1).
        *args: Positional arguments for ``fn``, the same on every rank.
        method: ``"thread"``, ``"fork"`` or ``"spawn"`` (default ``"thread"``).
        backend: The process group backend for ``"fork"`` and ``"spawn"`` (default
            ``"gloo"``); ``"thread"`` accepts only ``"gloo"``, which it stands in for.
        timeout: Seconds the ranks may take from when they are started, their process
            group's set-up included (default 120). Ranks still running then are asked
            for their Python stacks (the error shows them) and stopped: processes are
            terminated and then killed, threads get ``SystemExit`` raised in them (a
            thread inside one long C call cannot be stopped and is left as a daemon
            thread; the error says so).
        **kwargs: Keyword arguments for ``fn``.

    Returns:
        The ranks' return values, in rank order.

    Raises:
        RankFailedError: A rank raised (the message names the rank(s) and holds their
            formatted tracebacks), a process died, or a rank did not finish within
            ``timeout``. Once a rank fails, the others get 2 s to finish and are then
            stopped.
        ValueError: ``world_size``, ``method``, ``backend`` or ``timeout`` is invalid, or
            ``fn`` cannot be pickled for ``"spawn"``.
        RuntimeError: A default process group is already initialised here.

    Example:
        >>> import torch, torch.distributed as dist
        >>> def total():
        ...     x = torch.tensor([dist.get_rank() + 1.0])
        ...     dist.all_reduce(x)
        ...     return x.item()
        >>> run_on_ranks(total, 2)
        [3.0, 3.0]
    """
    call = (fn, args, kwargs)
    _validate(fn, world_size, call, method, backend, timeout)
    if method == "thread":
        outcomes = run_threads(fn, args, kwargs, world_size, timeout)
    else:
        outcomes = run_processes(fn, args, kwargs, world_size, method, backend, timeout)
    return results_or_raise(outcomes, method=method, world_size=world_size, timeout=timeout)
