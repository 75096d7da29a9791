"""The vocab-parallel lookup of an ``nn.Embedding`` subclass whose own ``forward`` computes
the ids it looks up: done at each ``F.embedding`` of its table while that forward runs.

A plain ``nn.Embedding`` looks up its first argument, which the runtime remaps to the rank's
rows before the forward and whose lookup it sums over the ranks after. A subclass may look up
something else: OPT's and BioGPT's learned positions are given the attention mask, BART's the
tokens (of which they read the length), and they look up the positions they compute from it;
remapping the first argument looked up every position in the rank's own rows, wrong with no
error. Here the ids are those of the lookup itself, and the lookup is summed over the ranks
before the subclass's forward goes on (a scale, a cast), so what it does after is exact too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

from ...core._embedding_ids import checked_ids
from ._layout import ActivationLayout

__all__ = ["around_table_lookups"]

_EMBEDDING_ARGS = (
    "input",
    "weight",
    "padding_idx",
    "max_norm",
    "norm_type",
    "scale_grad_by_freq",
    "sparse",
)


def around_table_lookups(
    module: nn.Embedding,
    path: str,
    layout: ActivationLayout,
    forward: Callable[..., Any],
    args: Any,
    kwargs: Any,
) -> Any:
    """Run ``forward`` (``module``'s, holding its vocab shard) with each lookup of its table
    vocab-parallel: the ids of the lookup checked against the whole vocab, looked up in the
    rank's rows, zeros elsewhere, summed over the axis."""
    with _TableLookups(module, path, layout):
        return forward(*args, **kwargs)


class _TableLookups(TorchFunctionMode):
    def __init__(self, module: nn.Embedding, path: str, layout: ActivationLayout) -> None:
        super().__init__()
        self.module, self.path, self.layout = module, path, layout

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not nn.functional.embedding:
            return func(*args, **kwargs)
        given = dict(zip(_EMBEDDING_ARGS, args, strict=False)) | kwargs
        if given["weight"] is not self.module.weight:
            return func(*args, **kwargs)
        total = self.module.num_embeddings
        ids = checked_ids(given["input"], total, self.path)
        first, count = self.layout.rows(total)
        outside = (ids < first) | (ids >= first + count)
        padding = given.get("padding_idx")
        padding = padding + total if padding is not None and padding < 0 else padding
        given["input"] = (ids - first).masked_fill(outside, 0)
        given["padding_idx"] = (
            padding - first if padding is not None and first <= padding < first + count else None
        )
        rows = func(**given)
        return self.layout.reduce_partial(rows.masked_fill(outside.unsqueeze(-1), 0), False)
