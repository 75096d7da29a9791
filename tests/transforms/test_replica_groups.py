"""The all-reduce over replica groups: buckets of one dtype, bounded in bytes, values in place."""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp

from d9d.transforms._replica_groups import all_reduce_over_groups


class TwoGroups:
    """A manager whose all-reduce sums this group's buffer with another group's (2 x itself)."""

    def __init__(self) -> None:
        self.sizes: list[tuple[torch.dtype, int]] = []

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp) -> TwoGroups:
        assert reduce_op == ReduceOp.SUM
        self.sizes.append((tensor.dtype, tensor.numel()))
        tensor.mul_(2)
        return self

    def wait(self) -> None:
        pass


def test_buckets_hold_at_most_the_bytes_given_and_every_tensor_once() -> None:
    """Float32 tensors of 10, 20, 30 and 50 elements (4 B an element) under a 120-byte cap: [10, 20],
    [30], [50] (a tensor larger than the cap goes alone); a float64 one in a bucket of its own;
    every value doubled in place of its tensor."""
    f32 = [torch.arange(n, dtype=torch.float32) for n in (10, 20, 30, 50)]
    f64 = torch.arange(7, dtype=torch.float64)
    tensors = [f32[0], f64, *f32[1:]]
    manager = TwoGroups()
    out = all_reduce_over_groups(manager, tensors, ReduceOp.SUM, bucket_bytes=120)
    assert manager.sizes == [
        (torch.float32, 30),
        (torch.float32, 30),
        (torch.float32, 50),
        (torch.float64, 7),
    ]
    for before, after in zip(tensors, out, strict=True):
        assert after.dtype == before.dtype and torch.equal(after, 2 * before)
