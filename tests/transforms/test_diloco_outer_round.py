"""One outer round of ``diloco`` against a hand-written DiLoCo: three replica groups as
threads, whose all-reduce sums their buffers, step the anchor over several rounds with
``torch.optim.SGD`` (Nesterov, heavy-ball or plain) on the token-weighted mean of their
pseudo-gradients, one group weighing 0 in a round (it took its peer's state there)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.distributed import ReduceOp

import d9d
from d9d.transforms.diloco._outer_round import outer_round

GROUPS = 3


class _Meeting:
    """What the groups' managers share: each all-reduce sums the buffers all of them give."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(GROUPS)
        self.given: list[torch.Tensor | None] = [None] * GROUPS


class _Manager:
    """Group ``group``'s manager: its all-reduce sums over the meeting; every round commits."""

    def __init__(self, meeting: _Meeting, group: int) -> None:
        self.meeting, self.group = meeting, group

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp) -> _Manager:
        assert reduce_op == ReduceOp.SUM
        self.meeting.given[self.group] = tensor.clone()
        self.meeting.barrier.wait()
        tensor.copy_(torch.stack(self.meeting.given).sum(0))
        self.meeting.barrier.wait()
        return self

    def wait(self) -> None:
        pass

    def should_commit(self) -> bool:
        return True


# Each round's tokens per group: uneven, and group 2 weighing 0 in round 1 (it healed there).
TOKENS = [(117, 64, 3), (90, 121, 0), (1, 200, 31)]


@pytest.mark.parametrize(("momentum", "nesterov"), [(0.9, True), (0.9, False), (0.0, False)])
def test_rounds_equal_torch_sgd_on_the_token_weighted_pseudo_gradients(
    momentum: float, nesterov: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    start = {
        "w": torch.randn(5, 3, dtype=torch.float64, generator=gen),
        "b": torch.randn(7, dtype=torch.float64, generator=gen),
    }
    outer = d9d.optim.sgd(0.7, momentum=momentum, nesterov=nesterov)
    anchors = [dict(start) for _ in range(GROUPS)]
    states = [outer.init(start) for _ in range(GROUPS)]
    reference = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    lr = torch.tensor(0.7, dtype=torch.float32).item()  # d9d's learning rate is float32
    sgd = torch.optim.SGD(reference.values(), lr=lr, momentum=momentum, nesterov=nesterov)
    meeting = _Meeting()
    for tokens in TOKENS:
        trained = [  # each group's params after its inner steps, from the shared anchor
            {k: v + 0.1 * torch.randn(v.shape, dtype=v.dtype, generator=gen) for k, v in a.items()}
            for a in anchors
        ]
        out: list = [None] * GROUPS

        def meet(g: int, tokens: tuple = tokens, trained: list = trained, out: list = out) -> None:
            out[g] = outer_round(
                _Manager(meeting, g),
                outer,
                anchors[g],
                states[g],
                trained[g],
                torch.tensor(tokens[g]),
            )

        threads = [threading.Thread(target=meet, args=(g,)) for g in range(GROUPS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for k, p in reference.items():
            pseudo = [tokens[g] * (p.detach() - trained[g][k]) for g in range(GROUPS)]
            p.grad = sum(pseudo) / sum(tokens)
        sgd.step()
        for g in range(GROUPS):
            anchors[g], states[g], committed = out[g]
            assert committed
            for k, a in anchors[g].items():  # every group holds the same anchor, bit for bit
                assert torch.equal(a, anchors[0][k]), (g, k)
        want = {k: p.detach() for k, p in reference.items()}
        d9d.testing.assert_trees_all_close(anchors[0], want, rtol=1e-13, atol=1e-15)
