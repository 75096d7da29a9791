"""``cross_entropy`` on vocab-sharded DTensor logits equals it on the whole logits."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

import d9d
from d9d.losses import cross_entropy
from d9d.testing import run_on_ranks


@pytest.mark.parametrize("vocab", [97, 8])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_sharded_logits_give_the_loss_and_grads_of_whole_logits(vocab: int, z_loss: float) -> None:
    """Uneven shards (97 over 3 ranks: 33, 33, 31), ignored labels, z-loss, float64."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, vocab, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, vocab, (2, 5), generator=g)
    labels[0, 1] = -100
    whole = logits.clone().requires_grad_(True)
    expected = cross_entropy(whole, labels, z_loss=z_loss)
    expected.backward()

    def rank():
        mesh = d9d.make_mesh("cpu", tp=3)
        sharded = distribute_tensor(logits, mesh, [Shard(2)], src_data_rank=None)
        sharded.requires_grad_(True)
        loss = cross_entropy(sharded, labels, z_loss=z_loss)
        loss.backward()
        return loss, sharded.grad.full_tensor()

    for loss, grad in run_on_ranks(rank, 3):
        assert not isinstance(loss, torch.distributed.tensor.DTensor)
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, whole.grad, rtol=1e-12, atol=1e-12)
