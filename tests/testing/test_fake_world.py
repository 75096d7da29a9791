"""fake_world: a simulated 64-rank world in this process, gone on exit."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from d9d.testing import fake_world, run_on_ranks


def test_builds_a_64_rank_2d_mesh_in_this_process() -> None:
    threads = threading.active_count()
    with fake_world(64, rank=13):
        assert (dist.get_rank(), dist.get_world_size()) == (13, 64)
        mesh = init_device_mesh("cpu", (8, 8), mesh_dim_names=("dp", "tp"))
        assert tuple(mesh.get_coordinate()) == (1, 5)
        local = distribute_tensor(torch.zeros(64, 32), mesh, [Shard(0), Shard(1)]).to_local()
        assert local.shape == (8, 4)
        assert threading.active_count() == threads  # no rank started, no process spawned
        assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


def test_group_is_destroyed_when_the_block_raises() -> None:
    with pytest.raises(KeyError), fake_world(8):
        raise KeyError("inside")
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("world_size", "rank", "match"),
    [
        (0, 0, r"world_size=0 must be an int >= 1"),
        (8, 8, r"rank=8 must be an int in \[0, 8\) for world_size=8"),
        (8, -1, r"rank=-1 must be an int in \[0, 8\)"),
    ],
)
def test_rejects_bad_sizes(world_size: int, rank: int, match: str) -> None:
    with pytest.raises(ValueError, match=match), fake_world(world_size, rank):
        pass


def test_rejects_nesting() -> None:
    with (
        fake_world(4),
        pytest.raises(RuntimeError, match=r"initialised \(backend 'cpu:fake,cuda:fake,meta:fake'"),
    ):
        fake_world(4).__enter__()
    assert not dist.is_initialized()


def test_point_to_point_ops_complete_at_once_on_meta_tensors() -> None:
    """A dry run of a pipeline step batches sends and receives of meta tensors."""
    with fake_world(4):
        meta = torch.empty(3, device="meta")
        ops = [dist.P2POp(dist.isend, meta, 1), dist.P2POp(dist.irecv, meta, 1)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _norm_over_a_submesh() -> float:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "fsdp"))["fsdp"]
    x = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm([x], 2))).full_tensor())


@pytest.mark.distributed
def test_a_real_world_after_it_gets_no_dtensor_on_its_meshes() -> None:
    """DTensor caches sharding by mesh layout; without clearing, a forked real world with an
    equal mesh got the fake mesh back and failed: "Could not resolve the process group"."""
    with fake_world(4):
        for _ in range(3):  # the fake mesh's group names are not the real one's
            dist.new_group([0, 1, 2, 3])
        _norm_over_a_submesh()
    assert run_on_ranks(_norm_over_a_submesh, 4, method="fork") == pytest.approx([14**0.5] * 4)
