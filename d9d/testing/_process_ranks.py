"""Ranks as forked or spawned processes joined through a FileStore in a temporary folder.

Each child initialises the default process group from a ``FileStore`` (no port to pick,
so no port races between parallel test runs), runs ``fn``, destroys the group and sends
back ``pickle.dumps`` of its return value, or its formatted traceback, through a pipe. A
rank still running at the deadline is asked for its Python stacks (``faulthandler`` on
SIGUSR1, into a file beside the store) before it is stopped, so a hang says where it hung.
Two things make that answer certain on a loaded machine: each child starts with SIGUSR1
blocked, so one that has not yet installed the handler keeps the signal pending instead of
dying of it, and the handler chains to Python's C-level signal handler, which writes a byte
to the wakeup fd (a file beside the stacks) once the stacks are written, so the parent
waits for that byte rather than for a fixed time.
Plain ``pickle`` copies tensor storage; ``multiprocessing``'s own pickler would pass shared
memory that dies with the child.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import multiprocessing
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from ._outcome import FAILURE_GRACE_S, STOP_GRACE_S, RankOutcome, summarize

# How long a rank asked for its stacks at the deadline may take to write them. Spent only
# where a rank does not answer: a rank that answers ends the wait.
STACKS_GRACE_S = 10.0

__all__ = ["run_processes"]


def _rank_main(
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]],
    writer: Connection,
) -> None:
    # One intra-op thread per rank, as torchrun sets OMP_NUM_THREADS=1 for several ranks.
    # After fork it is also required: GNU OpenMP's pool does not survive fork once the
    # parent used it, and a forked child's first parallel op (a 2000x2000 matmul) hung.
    torch.set_num_threads(1)
    _answer_stacks_requests(store_path, rank)
    failed_at = None
    try:
        fn, args, kwargs = call
        store = dist.FileStore(store_path, world_size)
        # No group timeout: the parent's deadline decides, and kills ranks stuck past it.
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        # Gloo's init returns on a rank once its own side of every connection is up: a rank
        # whose fn is quick could destroy the group and exit while another still connects
        # ("Connection closed by peer" there, seen under load). Every rank is connected past it.
        dist.barrier()
        try:
            value = fn(*args, **kwargs)
            # The same race for the groups ``fn`` made (a pipeline's pair of tied stages): a
            # rank that returns first would close its side while another still connects.
            # Every rank's ``fn`` has returned past this barrier, on success only: a failed
            # rank closes its connections at once, and the others fail in turn. An ``fn`` that
            # plays a rank's exit (a peer blocked on it must fail) ends the group itself.
            if dist.is_initialized():
                dist.barrier()
        except BaseException:
            # Taken before destroying the group, which closes this rank's connections and
            # makes the ranks waiting on it fail in turn.
            failed_at = time.time()
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        payload = pickle.dumps(("ok", value))
    except BaseException as exc:
        detail = "".join(traceback.format_exception(exc))
        payload = pickle.dumps(("raised", (detail, summarize(exc), failed_at or time.time())))
    writer.send_bytes(payload)
    writer.close()


def _answer_stacks_requests(store_path: str, rank: int) -> None:
    """On SIGUSR1, write every thread's Python stack to the stacks file, then a byte to the
    done file. SIGUSR1 is blocked until both are set up (it was blocked before the fork)."""
    stacks = open(_stacks_path(store_path, rank), "w")  # noqa: SIM115 (open while the rank runs)
    done = os.open(_done_path(store_path, rank), os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK)
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    signal.set_wakeup_fd(done, warn_on_full_buffer=False)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=True)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})


@contextlib.contextmanager
def _stacks_requests_held() -> Iterator[None]:
    """SIGUSR1 blocked in this thread, so the children forked or spawned from it start with
    it blocked and keep a request for their stacks pending until they can answer it."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _stacks_path(store_path: str, rank: int) -> str:
    return f"{store_path}.stacks-{rank}"


def _done_path(store_path: str, rank: int) -> str:
    """Where a rank's handler writes a byte once its stacks are written."""
    return f"{_stacks_path(store_path, rank)}.done"


def _stacks_written(store_path: str, rank: int) -> bool:
    with contextlib.suppress(OSError):
        return os.path.getsize(_done_path(store_path, rank)) > 0
    return False


def _stacks_at_deadline(
    procs: list[BaseProcess], ranks: list[int], store_path: str
) -> dict[int, str]:
    """The Python stacks of each of ``ranks`` still running at the deadline, by rank.
    ``faulthandler`` writes them from its C signal handler, at once even where the rank is
    blocked in C++ (a collective)."""
    asked = [r for r in ranks if procs[r].is_alive() and procs[r].pid is not None]
    for rank in asked:
        os.kill(procs[rank].pid, signal.SIGUSR1)  # type: ignore[arg-type]
    answer_by = time.monotonic() + STACKS_GRACE_S
    waiting = list(asked)
    while waiting and time.monotonic() < answer_by:
        time.sleep(0.01)
        waiting = [r for r in waiting if procs[r].is_alive() and not _stacks_written(store_path, r)]
    stacks = {}
    for rank in asked:
        with contextlib.suppress(OSError), open(_stacks_path(store_path, rank)) as file:
            if text := file.read().rstrip():
                stacks[rank] = f"Python stacks at the deadline (faulthandler):\n{text}"
    return stacks


def _decode(rank: int, payload: bytes) -> RankOutcome:
    try:
        status, value = pickle.loads(payload)
    except Exception as exc:
        summary = f"Its return value could not be unpickled in the parent process: {exc!r}"
        return RankOutcome(rank, "raised", summary=summary, failed_at=time.time())
    if status == "ok":
        return RankOutcome(rank, "ok", value=value)
    detail, summary, failed_at = value
    return RankOutcome(rank, "raised", detail=detail, summary=summary, failed_at=failed_at)


def _collect(
    readers: list[Connection], procs: list[BaseProcess], deadline: float
) -> list[RankOutcome | None]:
    """Each rank's report, until all have reported, died, or the deadline passed."""
    outcomes: list[RankOutcome | None] = [None] * len(procs)
    while None in outcomes:
        if any(o is not None and o.status != "ok" for o in outcomes):
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        pending = [rank for rank, o in enumerate(outcomes) if o is None]
        wait([readers[r] for r in pending] + [procs[r].sentinel for r in pending], remaining)
        for rank in pending:
            reader, proc = readers[rank], procs[rank]
            if reader.poll():
                try:
                    outcomes[rank] = _decode(rank, reader.recv_bytes())
                    continue
                except EOFError:  # the child closed its end without writing: it died
                    pass
            elif proc.is_alive():
                continue
            proc.join()
            summary = (
                f"Process exited with code {proc.exitcode} without reporting a result "
                "(killed by a signal if negative, or it called os._exit)."
            )
            outcomes[rank] = RankOutcome(rank, "crashed", summary=summary, failed_at=time.time())
    return outcomes


def _stop(procs: list[BaseProcess]) -> None:
    """Terminate, then kill, every child still alive, and reap them all."""
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.terminate()
    stop_by = time.monotonic() + STOP_GRACE_S
    for proc in alive:
        proc.join(max(0.0, stop_by - time.monotonic()))
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join()
        proc.close()


def run_processes(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    world_size: int,
    method: str,
    backend: str,
    timeout: float,
) -> list[RankOutcome]:
    """Run ``fn`` on ``world_size`` child processes started with ``method``."""
    context = multiprocessing.get_context(method)
    if method == "fork":
        # A forked child would collect this process's cyclic garbage (an earlier step's
        # meshes and DTensors, and the process groups they hold) without the threads those
        # were made with: a fork after in-process steps hung in the children's garbage
        # collection until run_on_ranks' timeout (tests/distributed/test_fault_tolerant_lone.py).
        gc.collect()
    procs: list[BaseProcess] = []
    readers: list[Connection] = []
    with tempfile.TemporaryDirectory(prefix="d9d-ranks-") as folder:
        store_path = os.path.join(folder, "store")
        try:
            with _stacks_requests_held():
                for rank in range(world_size):
                    reader, writer = context.Pipe(duplex=False)
                    readers.append(reader)
                    rank_args = (rank, world_size, backend, store_path, (fn, args, kwargs), writer)
                    proc = context.Process(
                        target=_rank_main, args=rank_args, name=f"d9d-rank-{rank}", daemon=True
                    )
                    proc.start()
                    procs.append(proc)
                    writer.close()
            # Counted from here: forking a large test process on a loaded machine is slow.
            collected = _collect(readers, procs, time.monotonic() + timeout)
            stuck = [rank for rank, o in enumerate(collected) if o is None]
            stacks = _stacks_at_deadline(procs, stuck, store_path) if stuck else {}
        finally:
            _stop(procs)
            for reader in readers:
                reader.close()
    failed = any(o is not None and o.status != "ok" for o in collected)
    unfinished = "stopped" if failed else "timed_out"
    return [
        o if o is not None else RankOutcome(rank, unfinished, detail=stacks.get(rank, ""))
        for rank, o in enumerate(collected)
    ]
