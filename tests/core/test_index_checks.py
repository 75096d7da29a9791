"""``d9d.core._index_checks``: which lookups of a captured graph get their index checked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from d9d.core._index_checks import guard_indices
from d9d.errors import IndexRangeError


def test_only_indices_computed_from_integer_inputs_are_guarded() -> None:
    counts = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        counts.append(guard_indices(graph))
        return graph.forward

    @torch.compile(backend=backend)
    def lookups(table, ids, scores):
        top = scores.argmax(-1, keepdim=True)  # computed by the model: in range, not guarded
        return F.embedding(ids[:, 1:], table), scores.gather(-1, top)

    table, scores = torch.randn(10, 3), torch.randn(2, 5)
    lookups(table, torch.zeros(2, 4, dtype=torch.long), scores)
    assert counts == [1]
    ids = torch.zeros(2, 4, dtype=torch.long)
    ids[1, 2] = 10
    with pytest.raises(
        IndexRangeError,
        match=r"L\['ids'\], the index of an embedding over 10 entries, holds 10 at position "
        r"\(1, 1\), outside \[0, 10\)",
    ):
        lookups(table, ids, scores)
