"""``cross_entropy`` on vocab-sharded DTensor logits equals it on the whole logits."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

import d9d
from d9d.errors import LabelError, RankFailedError
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


@pytest.mark.parametrize("bad", [8, 100, -3])
def test_a_label_outside_the_vocab_is_an_error_whole_or_sharded(bad: int) -> None:
    """Sharded logits used to return the log-sum-exp, as if the target logit were 0."""
    logits = torch.randn(2, 3, 8, dtype=torch.float64)
    labels = torch.tensor([[1, 2, 3], [4, bad, -100]])
    match = rf"labels must be in \[0, 8\) or ignore_index=-100: got {bad} at \(1, 1\)"
    with pytest.raises(LabelError, match=match):
        cross_entropy(logits, labels)

    def rank():
        mesh = d9d.make_mesh("cpu", tp=2)
        cross_entropy(distribute_tensor(logits, mesh, [Shard(2)], src_data_rank=None), labels)

    with pytest.raises(RankFailedError, match=f"LabelError: cross_entropy {match}"):
        run_on_ranks(rank, 2)


@pytest.mark.compile  # aot_eager: checks tracing without inductor codegen
def test_under_compile_a_label_outside_the_vocab_sharded_gives_nan() -> None:
    """No value is read back in a graph, and no shard looks the global label up: the
    documented result is a NaN loss (the token's own under ``reduction="none"``); other tokens
    are exact. (Whole logits hand the label to the gather, whose index ``d9d.jit`` checks:
    tests/core/test_jit.py.)"""
    logits = torch.randn(2, 3, 8, dtype=torch.float64)
    labels = torch.tensor([[1, 2, 3], [4, 8, -100]])
    good = labels.clone()
    good[1, 1] = -100
    expected = cross_entropy(logits, good, reduction="none")
    compiled = torch.compile(cross_entropy, fullgraph=True, backend="aot_eager")

    def rank():
        mesh = d9d.make_mesh("cpu", tp=2)
        sharded = distribute_tensor(logits, mesh, [Shard(2)], src_data_rank=None)
        return compiled(sharded, labels, reduction="none"), compiled(sharded, labels)

    for loss, mean in run_on_ranks(rank, 2):
        assert loss[1, 1].isnan() and loss.isnan().sum() == 1 and mean.isnan()
        torch.testing.assert_close(loss.nan_to_num(0.0), expected)
