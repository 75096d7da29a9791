"""``KeptBytes``: the same bytes on meta as on CPU, each storage once, exclusions, the
snapshot at the first backward op, DTensors by their local shard."""

from __future__ import annotations

import doctest

import torch
from torch.distributed.tensor import Shard, distribute_tensor

import d9d
from d9d.testing import KeptBytes, _kept_bytes, run_on_ranks


def test_docstring_example() -> None:
    assert doctest.testmod(_kept_bytes, extraglobs={"torch": torch}).failed == 0


def _kept(device: str) -> tuple[int, int]:
    w = torch.ones(8, 4, device=device, requires_grad=True)
    x = torch.ones(3, 8, device=device)
    with KeptBytes(exclude={"w": w}) as kept:
        h = (x @ w).relu()  # relu keeps its output h; x @ w dies
        view = w.t()  # a view of an excluded storage
        both = torch.cat([h, h])  # cat keeps nothing; the caller keeps its output
        both.sum().backward()
    del view
    return kept.before_backward, kept.alive()


def test_meta_keeps_what_cpu_keeps() -> None:
    # Before the backward: h (3 x 4), both (6 x 4), the sum and the backward's seed.
    assert _kept("cpu")[0] == (12 + 24 + 1 + 1) * 4
    assert _kept("meta") == _kept("cpu")


def test_a_dtensor_counts_its_local_shard() -> None:
    def rank() -> int:
        mesh = d9d.make_mesh("cpu", tp=2)
        x = distribute_tensor(torch.ones(8, 6), mesh, [Shard(0)])
        with KeptBytes() as kept:
            y = x * 2  # a DTensor whose local shard is 4 x 6 float32
        assert y.to_local().shape == (4, 6)
        return kept.alive()

    assert run_on_ranks(rank, 2) == [96, 96]
