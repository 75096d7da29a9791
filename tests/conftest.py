"""Shared test settings: deterministic CPU runs, a per-session inductor cache, and the longest
tests first."""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

DURATIONS = Path(__file__).with_name("durations.json")
"""Seconds each slow test took in a CI run (``python .ci/durations.py JUNIT_XML`` writes it)."""


def pytest_configure(config: pytest.Config) -> None:
    """Each xdist worker takes its share of the cores for torch's intra-op threads (at most 2):
    two workers of 2 threads each on this 2-core machine ran the non-compiled distributed tests
    5-8% slower than two of 1 thread (``tests/distributed -m "not compile"``, 274/282 s against
    250/266 s)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // workers)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first, by :data:`DURATIONS`; the others keep their order after them.
    xdist hands out one test at a time (``--maxschedchunk=1`` in ``pyproject.toml``), so the
    workers end together instead of one running a tail of slow tests alone."""
    seconds = json.loads(DURATIONS.read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid, 0.0))


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    """Each test starts without a default process group: a one-device step without a mesh
    starts an implicit one-rank group that lives for the process (``docs/sharding.md``, "The mesh"), and
    a ``run_on_ranks`` or ``fake_world`` test after it on the same xdist worker refused to
    start (every later such test on that worker failed)."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        _clear_sharding_prop_cache()  # its entries hold that world's meshes


@pytest.fixture(autouse=True)
def _fresh_dynamo(request: pytest.FixtureRequest) -> None:
    """A compiled test starts with Dynamo's caches empty: what earlier tests on the same xdist
    worker compiled (or gave up on: a code object Dynamo marked to skip runs eagerly from
    then on) must not decide what this one traces. Seen in CI: ``torch.compile(cross_entropy,
    fullgraph=True)`` found "no compiled frames" after other compiled tests on its worker."""
    if request.node.get_closest_marker("compile") is not None:
        torch._dynamo.reset()


@pytest.fixture
def fresh_processes() -> multiprocessing.context.ForkServerContext:
    """Start child processes from a fork server: a fresh process with torch and d9d imported,
    started once per xdist worker. A child forked from the test process inherits the locks its
    threads (xdist's, an earlier test's gloo or store threads) held at the fork, and cyclic
    garbage whose collection waits on those threads: such a child hung before joining its
    group (CI, tests/core/test_process_group.py). tensorstore also aborts a forked child that
    uses it once the parent has."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "d9d.cli"])
    return context


@pytest.fixture(scope="session", autouse=True)
def _inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor-cache")))


@pytest.fixture
def one_rank_mesh():
    """A 1-rank gloo process group and its 1-D CPU device mesh, torn down afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def math_attention():
    """SDPA's math kernel for the test. torch 2.11's inductor cannot compile the backward of
    CPU flash attention in float64: its fake kernel makes the log-sum-exp float32, so inductor
    copies the real float64 one into a float32 buffer ("expected scalar type Double but found
    Float"); 2.13's fake kernel has the query's dtype. The flag is process-wide: thread ranks
    started inside the test see it too."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield
