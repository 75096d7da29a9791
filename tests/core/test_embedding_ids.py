"""``d9d.core._embedding_ids``: eager steps check the ids an embedding's table is indexed with,
also where an ``nn.Embedding`` subclass computes them in its own forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import d9d
from d9d.errors import IndexRangeError


class MaskPositions(nn.Embedding):
    """OPT's and BioGPT's learned positions: given the attention mask (float), not ids."""

    def forward(self, mask: torch.Tensor) -> torch.Tensor:
        return super().forward((mask.cumsum(1) * mask - 1).long() + 2)


class TokenPositions(nn.Embedding):
    """BART's learned positions: given the tokens, of which it reads only the length."""

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return super().forward(positions + 2)


class Model(nn.Module):
    def __init__(self, positions: nn.Embedding) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(97, 4), positions

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        where = mask if isinstance(self.positions, MaskPositions) else tokens
        return self.tokens(tokens) + self.positions(where)


@pytest.mark.parametrize("kind", [MaskPositions, TokenPositions])
def test_a_subclass_whose_forward_computes_its_ids_is_checked_at_its_lookup(kind) -> None:
    """Its first argument is no index of its table (a float mask; tokens past its 10 rows):
    before, the check refused it (TypeError, IndexRangeError) on one device."""
    torch.manual_seed(0)
    module = Model(kind(10, 4))
    model = d9d.functionalize(module)
    tokens = torch.tensor([[90, 3, 5, 96], [1, 2, 3, 4]])
    mask = torch.ones(2, 4)
    torch.testing.assert_close(model.apply(model.params, tokens, mask), module(tokens, mask))
    too_long = torch.randint(0, 97, (2, 9))  # 9 + 2 positions: past its 10 rows
    with pytest.raises(
        IndexRangeError,
        match=r"the index of embedding 'positions' over 10 entries, holds 10 at position "
        r"\((0, )?8,?\), outside \[0, 10\)",
    ):
        model.apply(model.params, too_long, torch.ones(2, 9))
    # the subclass's forward left as it was: no mode stays on after it, even after an error
    assert not torch._C._is_torch_function_mode_enabled()
    assert not module.positions._forward_pre_hooks and not module.positions._forward_hooks


def test_the_tokens_of_a_plain_embedding_are_still_named_in_its_error() -> None:
    model = d9d.functionalize(Model(TokenPositions(10, 4)))
    tokens = torch.tensor([[1, 2, 97, 4]])

    def loss_fn(params, batch):
        return model.apply(params, batch["tokens"]).sum()

    with pytest.raises(
        IndexRangeError,
        match=r"batch\['tokens'\], the index of embedding 'tokens' over 97 entries, holds 97",
    ):
        d9d.value_and_grad(loss_fn)(model.params, {"tokens": tokens})
