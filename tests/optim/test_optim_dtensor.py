"""Optimizers on DTensor leaves give the numbers of the same optimizer on plain tensors.

The trees mix plain tensors and DTensors with ``Shard``/``Replicate`` placements, so the
foreach grouping, the global norm (one reduction per mesh, see ``_clipping.py``) and the
state placements are all exercised, on a 1-rank mesh and on a 2x2 mesh of thread ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

import d9d.optim as optim
from d9d.optim._transform import by_kind, foreach_lerp
from d9d.testing import run_on_ranks

SHAPES = {"a.bias": (7,), "a.weight": (6, 3), "b.weight": (4, 3, 2), "c.weight": (5, 4)}


def run_placed_and_plain(mesh: DeviceMesh, placements: dict[str, list[Placement] | None]):
    """Three clipped AdamW steps on placed and on plain params; the largest differences."""
    generator = torch.Generator().manual_seed(0)
    params = {path: torch.randn(shape, generator=generator) for path, shape in SHAPES.items()}

    def place(tree_):  # a path mapped to None stays a plain tensor
        return {
            path: x if placements[path] is None else distribute_tensor(x, mesh, placements[path])
            for path, x in tree_.items()
        }

    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, mask=r"weight$"))
    plain, plain_state = params, opt.init(params)
    placed, placed_state = place(params), opt.init(place(params))
    norm_error = 0.0
    for _ in range(3):
        grads = {p: 3 * torch.randn(shape, generator=generator) for p, shape in SHAPES.items()}
        norm = optim.global_norm(place(grads))
        assert type(norm) is torch.Tensor and norm.shape == ()
        norm_error = max(norm_error, abs(norm - optim.global_norm(grads)).item())
        updates, plain_state = opt.update(grads, plain_state, plain)
        plain = optim.apply_updates(plain, updates)
        updates, placed_state = opt.update(place(grads), placed_state, placed)
        placed = optim.apply_updates(placed, updates)

    for path, wanted in placements.items():
        for tree_ in (placed, placed_state[1][0].mu):
            assert isinstance(tree_[path], DTensor) == (wanted is not None), path
            assert wanted is None or list(tree_[path].placements) == wanted, path
    param_error = max(
        (x.full_tensor() if isinstance(x, DTensor) else x).sub(plain[path]).abs().max().item()
        for path, x in placed.items()
    )
    return norm_error, param_error


def test_foreach_lerp_of_dtensors_equals_that_of_their_shards(one_rank_mesh) -> None:
    """DTensors take one ``torch.lerp`` each: torch 2.11 shards no ``_foreach_lerp``."""
    g = torch.Generator().manual_seed(0)
    starts, ends = ([torch.randn(4, 3, generator=g) for _ in range(2)] for _ in range(2))
    placed = [
        [
            distribute_tensor(t, one_rank_mesh, [p])
            for t, p in zip(ts, [Shard(0), Replicate()], strict=True)
        ]
        for ts in (starts, ends)
    ]
    got = foreach_lerp(*placed, 0.1)
    assert all(isinstance(x, DTensor) for x in got)
    expected = torch._foreach_lerp(starts, ends, 0.1)
    for x, e in zip(got, expected, strict=True):
        torch.testing.assert_close(x.full_tensor(), e, rtol=0, atol=0)
    plain = foreach_lerp(starts, ends, 0.1)
    assert all(torch.equal(x, e) for x, e in zip(plain, expected, strict=True))


def test_one_rank_mesh(one_rank_mesh) -> None:
    placements = {"a.bias": None, "a.weight": [Shard(0)], "b.weight": [Replicate()]}
    placements["c.weight"] = [Shard(1)]
    norm_error, param_error = run_placed_and_plain(one_rank_mesh, placements)
    assert norm_error <= 2e-6 and param_error <= 1e-6


def _on_2x2_mesh():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    placements = {
        "a.bias": None,
        "a.weight": [Shard(0), Replicate()],
        "b.weight": [Replicate(), Shard(2)],
        "c.weight": [Shard(1), Shard(0)],
    }
    return run_placed_and_plain(mesh, placements)


@pytest.mark.distributed
def test_four_ranks_on_a_2x2_mesh() -> None:
    for rank, (norm_error, param_error) in enumerate(run_on_ranks(_on_2x2_mesh, 4)):
        assert norm_error <= 2e-6 and param_error <= 1e-6, f"{rank=}"


def _foreach_on_shards_or_not(counted: dict[int, int]) -> list[str]:
    """by_kind on a 3-D mesh (two size-1 axes) against DTensor's own foreach, bitwise; the
    shard path wraps each output with one ``from_local``, the DTensor path with none."""
    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("pp", "cp", "tp"))
    generator = torch.Generator().manual_seed(1)
    full = [torch.randn(5, 3, generator=generator) for _ in range(6)]
    layouts = [[Replicate(), Replicate(), Shard(i % 2)] for i in range(3)]
    layouts += [[Replicate()] * 3, [Shard(0), Replicate(), Shard(1)], [Replicate()] * 3]
    xs = [distribute_tensor(x, mesh, p) for x, p in zip(full, layouts, strict=True)]
    ys = [distribute_tensor(2 * x + 1, mesh, p) for x, p in zip(full, layouts, strict=True)]
    halves = [  # sum over tp: 2 * x + 1 again
        DTensor.from_local((x + 0.5).contiguous(), mesh, [Replicate(), Replicate(), Partial()])
        for x in full
    ]
    scale = torch.tensor(0.25)

    def step(a, b):
        return torch._foreach_addcmul(a, b, b, 0.5), torch._foreach_mul(a, scale)

    cases = {
        "aligned": (xs, ys, 2 * len(xs)),
        "placements differ": (xs, ys[1:] + ys[:1], 0),
        "partial": (xs, halves, 0),
    }
    failures = []
    for name, (a, b, wraps) in cases.items():
        before = counted[dist.get_rank()]
        got = by_kind(step, a, b, outputs=2)
        calls = counted[dist.get_rank()] - before
        if calls != wraps:
            failures.append(f"{name}: {calls} from_local calls, not {wraps}")
        for g, w in zip(got, step(a, b), strict=True):
            for x, y in zip(g, w, strict=True):
                if x.placements != y.placements or not torch.equal(
                    x.full_tensor(), y.full_tensor()
                ):
                    failures.append(f"{name}: differs from DTensor's foreach")
    return failures


def test_foreach_runs_on_local_shards_when_layouts_align(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = {0: 0, 1: 0}  # per rank: the ranks are threads
    from_local = DTensor.from_local

    def counting(*args, **kwargs):
        counted[dist.get_rank()] += 1
        return from_local(*args, **kwargs)

    monkeypatch.setattr(DTensor, "from_local", counting)
    assert run_on_ranks(_foreach_on_shards_or_not, 2, counted) == [[], []]
