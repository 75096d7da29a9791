"""Exiting a gloo rank without aborting: the workers' last tensors are let go before the
interpreter finalizes.

A gloo worker thread (``pt_gloo_runloop``) lets go of its collective's tensors just after the
caller's ``wait()`` has returned. Where a tensor also has a Python object, that release takes
the GIL (PyTorch's PyObject preservation). If the main thread has meanwhile begun to finalize
the interpreter, CPython ends the worker with ``pthread_exit`` as it takes the GIL, the unwind
crosses a ``noexcept`` destructor, and the rank dies of ``terminate called without an active
exception`` (SIGABRT) after all its work is done (pytorch/pytorch#190489). A group that
outlives ``destroy_process_group()`` (a ``DeviceMesh`` holds its groups) leaves its workers
running into finalization (that call shuts a group's backend down, and gloo's shutdown is the
``Backend`` default, which does nothing; NCCL's has one of its own); on a loaded machine a
worker lags the main thread by many milliseconds. Seen in CI: rank 1 of ``d9d train --fsdp 2``
and of ``docs/huggingface.md``'s ``train_hf.py``; reproduced by 2 ranks and 3 busy loops on one
core (18 aborts in 20 runs one afternoon, 3 in 6 another).

:func:`wait_for_collective_threads` runs at exit (``atexit``, the interpreter still whole)
and releases the GIL until every worker thread is asleep in two readings in a row. A worker
waiting for the GIL is woken by each release (and then runs or is runnable), a worker not yet
at its release is runnable, and one waiting for the workers' lock waits on one of those: two
readings of sleeping workers with a release between them mean that none has a tensor left to
let go of. Linux only (``/proc``); elsewhere it returns at once.
"""

from __future__ import annotations

import atexit
import os
import time

__all__ = ["wait_at_exit_for_collective_threads", "wait_for_collective_threads"]

# The name gloo gives its worker threads (ProcessGroupGloo's run loop), as /proc shows it.
GLOO_WORKER_NAME = "pt_gloo_runloop"
TASKS = "/proc/self/task"


def wait_at_exit_for_collective_threads() -> None:
    """Make this process run :func:`wait_for_collective_threads` at exit (once, however often
    it is asked): for a process that joins gloo groups (``init_process_group``, a torchft
    replica group's manager)."""
    atexit.unregister(wait_for_collective_threads)
    atexit.register(wait_for_collective_threads)


def wait_for_collective_threads(limit_s: float = 10.0) -> bool:
    """Release the GIL until every gloo worker thread of this process sleeps, at most
    ``limit_s`` seconds; ``True`` once they all sleep (or where ``/proc`` is absent).

    Example:
        >>> from d9d.launch._exit import wait_for_collective_threads
        >>> wait_for_collective_threads()  # no gloo group in this process: at once
        True
    """
    if not os.path.isdir(TASKS):
        return True
    give_up_at = time.monotonic() + limit_s
    asleep_before = False
    while time.monotonic() < give_up_at:
        time.sleep(0.001)  # releases the GIL: a worker waiting for it is woken
        asleep = all(state == "S" for state in _worker_states())
        if asleep and asleep_before:
            return True
        asleep_before = asleep
    return False


def _worker_states() -> list[str]:
    """The scheduler state (``R``, ``S``, ...) of each gloo worker thread of this process."""
    states = []
    for task in os.scandir(TASKS):
        try:
            with open(f"{task.path}/comm") as comm:
                if comm.read().strip() != GLOO_WORKER_NAME:
                    continue
            with open(f"{task.path}/stat") as stat:
                states.append(stat.read().rpartition(")")[2].split()[0])
        except OSError:  # the thread ended since the listing
            continue
    return states
