"""``dispatch_layout``/``dispatch``/``combine`` refuse bad input by name, before any
collective (on a simulated group); the layout of a few tokens by hand. Values
against every expert run locally: ``tests/distributed/test_expert_dispatch.py``."""

from __future__ import annotations

import pytest
import torch

import d9d
import d9d.kernels as K
from d9d.errors import KernelInputError
from d9d.testing import fake_world


def test_layout_counts_a_token_once_per_rank() -> None:
    """4 experts on 2 ranks: token 0 has experts 0 and 1 (both on rank 0), token 1 experts
    3 and 0, token 2 experts 2 and 3 (both on rank 1)."""
    layout = K.dispatch_layout(torch.tensor([[0, 1], [3, 0], [2, 3]]), 4, 2)
    assert layout.token_in_rank.tolist() == [[True, False], [True, True], [False, True]]
    assert layout.tokens_per_rank.tolist() == [2, 2]
    assert layout.tokens_per_expert.tolist() == [2, 1, 1, 2]


def test_layout_refusals() -> None:
    with pytest.raises(KernelInputError, match=r"topk_ids must be an int32 or int64 tensor"):
        K.dispatch_layout(torch.zeros(3, 2), 4, 2)
    with pytest.raises(
        KernelInputError, match=r"num_experts=6 experts must split evenly over ranks=4"
    ):
        K.dispatch_layout(torch.zeros(3, 2, dtype=torch.long), 6, 4)


def _refusal(kind: str) -> None:
    with fake_world(2):
        group = d9d.make_mesh("cpu", ep=2).get_group("ep")
        x, ids, weights = torch.ones(3, 4), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.ones(3, 2)
        layout = K.dispatch_layout(ids, 4, 2)
        if kind == "shapes":
            K.dispatch(x[:2], ids, weights, layout, group)
        if kind == "weights":
            K.dispatch(x, ids, weights[:, :1], layout, group)
        if kind == "layout":
            K.dispatch(x, ids, weights, K.dispatch_layout(ids, 4, 1), group)
        if kind == "dtype":
            K.dispatch(x.long(), ids, weights, layout, group)
        # On meta the simulated group's sizes are uniform routing's, not its meaningless data.
        meta = [t.to("meta") for t in (x, ids, weights)]
        rows, _, handle = K.dispatch(*meta, K.dispatch_layout(meta[1], 4, 2), group)
        if kind == "rows":
            K.combine(rows[1:], handle)
        if kind == "backend":
            K.combine(rows, handle, backend="reference")


REFUSALS = {
    "shapes": r"dispatch: x must be \[T, dim\] and topk_ids \[T, k\], got x\.shape=torch\.Size\(\[2, 4\]\)",
    "weights": r"dispatch: topk_weights must be shaped like topk_ids",
    "layout": r"dispatch: the layout is of \(3, 1\) \(tokens, ranks\), the call of 3 tokens on a "
    r"group of 2 ranks: build it with dispatch_layout\(topk_ids, num_experts, 2\)",
    "dtype": r"dispatch.*x.*float",
    "rows": r"combine: outputs must be \[\d+, dim'\] \(a row per dispatched row\)",
    "backend": r"combine: backend='reference', but the handle comes from the 'c10d' dispatch",
}


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_dispatch_and_combine_refusals(kind: str) -> None:
    with pytest.raises(KernelInputError, match=REFUSALS[kind]):
        _refusal(kind)
