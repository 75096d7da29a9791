"""Ranks as threads of this process, over PyTorch's in-process "threaded" process group.

The threaded group (``torch.testing._internal.distributed.multi_threaded_pg``, the one
``MultiThreadedTestCase`` uses) swaps ``torch.distributed``'s world for a thread-local one,
so every thread holds its own default group and collectives hand tensors between threads.
Starting four ranks this way takes milliseconds, against about 8 s for four spawned
gloo processes on a 2-core machine.

Rank 0's thread runs each collective for all ranks, on a ``Collective`` object that holds
every rank's tensors and that each rank references until it returns from the collective.
A rank that lags there (the GIL, a loaded machine) would keep the others' tensors alive
after they have moved on, so what a rank measures as alive (``KeptBytes``) would depend on
another thread's timing: the collective lets go of them once it has run
(:func:`_releasing_collective`).

DTensor caches how it redistributes a tensor (``_gen_transform_infos``, by the two specs) and
its planners (``get_redistribute_planner``, by the mesh), and both compare meshes by layout,
not identity; but what they cache holds the calling rank's mesh coordinate, and so its shard
sizes where a dim is sharded unevenly over two mesh axes (35 rows over ``fsdp=2`` then
``tp=3``: 6 or 5). Processes each have their own caches; threads share them, so a rank
redistributed with another's sizes: a shape error, or wrong values with none (a
``(Shard(0), Shard(0))`` tensor of 35 rows gathered wrong on every rank of a second run;
StarCoder2's uneven MLP bias at ``fsdp=2 x tp=3``, rel 1.0 and 16 off). While thread ranks
run, both caches are kept per rank (:func:`_per_rank_caches`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._outcome import FAILURE_GRACE_S, STOP_GRACE_S, RankOutcome, summarize

__all__ = ["run_threads"]


def _rank_main(
    rank: int,
    world_size: int,
    store: dist.Store,
    timeout: float,
    call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]],
    world: Any,
    outcomes: list[RankOutcome | None],
    finished: threading.Condition,
) -> None:
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

    # One intra-op thread per rank, as for process ranks (``torchrun`` sets it for several
    # ranks). Set on the rank's own thread: MKL in a new thread otherwise takes OpenMP's
    # default (every core) whatever the main thread set, and starts a pool of its own.
    torch.set_num_threads(1)
    fn, args, kwargs = call
    try:
        # The timeout bounds the start-up barrier, a C++ wait that SystemExit cannot reach.
        dist.init_process_group(
            "threaded",
            rank=rank,
            world_size=world_size,
            store=store,
            timeout=timedelta(seconds=timeout),
        )
        try:
            outcome = RankOutcome(rank, "ok", value=fn(*args, **kwargs))
        finally:
            # A rank abandoned after a timeout may get here after the world was uninstalled;
            # it must not destroy whatever group the main thread has made since.
            if dist.distributed_c10d._world is world:
                dist.destroy_process_group()
    except SystemExit as exc:
        # The threaded group raises SystemExit in ranks waiting on a collective once a
        # rank failed, and the runner raises it in ranks it stops after a timeout.
        if ProcessLocalGroup._terminate.is_set():
            outcome = RankOutcome(rank, "stopped")
        else:
            outcome = _raised(rank, exc)
    except BaseException as exc:
        outcome = _raised(rank, exc)
        ProcessLocalGroup.exception_handle(exc)  # wake the ranks waiting on a collective
    with finished:
        outcomes[rank] = outcome
        finished.notify_all()


def _raised(rank: int, exc: BaseException) -> RankOutcome:
    detail = "".join(traceback.format_exception(exc))
    return RankOutcome(rank, "raised", detail=detail, summary=summarize(exc), failed_at=time.time())


def _raise_in_thread(thread: threading.Thread) -> None:
    # CPython's way to interrupt another thread: SystemExit is raised in it at its next
    # bytecode. A thread inside one long C call (a single time.sleep) is only reached
    # when that call returns.
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit)
    )


def _wait_until_exited(native_ids: list[int | None], limit_s: float = 1.0) -> None:
    """Waits until the native threads of joined rank threads are gone (Linux; elsewhere it
    returns at once): a joined Python thread's native thread may still be running its
    thread-local destructors, and a ``fork`` meanwhile (the next ``run_on_ranks(method=
    "fork")``) would copy whatever lock it holds. A precaution: ``docs/testing.md``."""
    until = time.monotonic() + limit_s
    for native_id in native_ids:
        while os.path.exists(f"/proc/self/task/{native_id}") and time.monotonic() < until:
            time.sleep(0.001)


class _ReleasedAfterWork:
    """A threaded collective's work that then drops every rank's tensors from the list it
    was given (the ``Collective``'s own): each rank returns its own from its own frame."""

    def __init__(self, work: Any) -> None:
        self.inner = work

    def work(self, data: list[Any]) -> None:
        try:
            self.inner.work(data)
        finally:
            data[:] = [None] * len(data)


def _releasing_collective(base: type) -> type:
    class _ReleasingCollective(base):  # type: ignore[misc, valid-type]
        def __init__(self, world_size: int, collective: Any, pg: Any) -> None:
            super().__init__(world_size, _ReleasedAfterWork(collective), pg)

    return _ReleasingCollective


@contextmanager
def _per_rank_caches() -> Iterator[None]:
    """DTensor's redistribution caches, kept per rank of the calling thread while the block
    runs (see the module docstring)."""
    from torch.distributed.tensor import _redistribute as redistribute

    shared = redistribute._gen_transform_infos, redistribute.get_redistribute_planner
    planners: dict[Any, Any] = {}

    @functools.cache
    def of_rank(rank: int, src: Any, dst: Any, graph_based: bool | None) -> Any:
        return redistribute._gen_transform_infos_non_cached(src, dst, graph_based)

    def transform_infos(src: Any, dst: Any, use_graph_based_transform: bool | None = None) -> Any:
        return of_rank(dist.get_rank(), src, dst, use_graph_based_transform)

    def planner(mesh: Any, meta: Any) -> Any:
        if redistribute._are_we_tracing():  # as DTensor's own: a planner per trace
            return redistribute.DTensorRedistributePlanner(mesh, meta)
        key = (dist.get_rank(), id(mesh), meta)
        found = planners.get(key)
        if found is None or found[0] is not mesh:  # held: its id is not reused meanwhile
            found = planners[key] = (mesh, redistribute.DTensorRedistributePlanner(mesh, meta))
        return found[1]

    transform_infos.cache_clear = of_rank.cache_clear  # type: ignore[attr-defined]
    redistribute._gen_transform_infos = transform_infos
    redistribute.get_redistribute_planner = planner
    try:
        yield
    finally:
        redistribute._gen_transform_infos, redistribute.get_redistribute_planner = shared


def run_threads(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    world_size: int,
    timeout: float,
) -> list[RankOutcome]:
    """Run ``fn`` on ``world_size`` threads, each a rank of a threaded process group."""
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    outcomes: list[RankOutcome | None] = [None] * world_size
    finished = threading.Condition()
    store = dist.HashStore()
    if not torch.cuda.is_available():
        # Tracing (fake tensors) without a usable GPU installs a no-op CUDA device guard on
        # first use. torch 2.11 keeps that guard in the installing thread's thread-local
        # storage but registers it process-wide, so once a rank thread that traced first
        # exits, the next trace on another thread calls into freed memory (a segfault in
        # ``ensureCUDADeviceGuardSet``, seen with two compiled thread-rank tests in a row).
        # Installing it here, on the thread that outlives the ranks, is what FakeTensorMode
        # itself calls on entry in that case; 2.13 keeps the guard in static storage.
        torch._C._ensureCUDADeviceGuardSet()
    # Functional collectives (DTensor) resolve groups by name; isolation mode makes that
    # registry per thread, as it is per process for real ranks.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    world = threaded._install_threaded_pg()
    caches = _per_rank_caches()
    caches.__enter__()
    collective = threaded.Collective
    threaded.Collective = _releasing_collective(collective)
    if not hasattr(type(world), "comms"):
        # torch 2.11's destroy_process_group iterates the world's ``comms`` (torchcomms
        # communicators), which that version's threaded world lacks; a threaded group has none.
        world.comms = []
    intra_op_threads = torch.get_num_threads()  # each rank sets 1; restored at the end
    threads = [
        threading.Thread(
            target=_rank_main,
            args=(rank, world_size, store, timeout, (fn, args, kwargs), world, outcomes, finished),
            name=f"d9d-rank-{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        with finished:
            while None in outcomes:
                if any(o is not None and o.status == "raised" for o in outcomes):
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                finished.wait(remaining)
            running = [t for t, o in zip(threads, outcomes, strict=True) if o is None]
            frames = sys._current_frames()
            stacks = {
                t: "Python stack at the deadline:\n" + "".join(traceback.format_stack(frame))
                for t in running
                if (frame := frames.get(t.ident or -1)) is not None
            }
            if running:
                threaded.ProcessLocalGroup.exception_handle(None)
                for thread in running:
                    _raise_in_thread(thread)
        for thread in running:
            thread.join(STOP_GRACE_S)
        failed = any(o is not None and o.status == "raised" for o in outcomes)
        for rank, thread in enumerate(threads):
            if thread in running:
                blocked = (
                    f"Thread {thread.name} is blocked outside Python (in a C call) and could "
                    "not be stopped; it is left running as a daemon thread.\n"
                    if thread.is_alive()
                    else ""
                )
                detail = blocked + stacks.get(thread, "")
                outcomes[rank] = RankOutcome(
                    rank, "stopped" if failed else "timed_out", detail=detail
                )
        for thread in threads:
            if thread not in running:  # it has reported and is returning
                thread.join(STOP_GRACE_S)
        _wait_until_exited([t.native_id for t in threads if not t.is_alive()])
    finally:
        torch.set_num_threads(intra_op_threads)
        threaded.ProcessLocalGroup.reset()
        threaded.Collective = collective
        threaded._uninstall_threaded_pg()
        caches.__exit__(None, None, None)
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    return [o for o in outcomes if o is not None]
