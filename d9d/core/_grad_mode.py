"""Modules whose forward computes without autograd: nothing they output carries a grad.

A module whose ``forward`` is decorated with ``torch.no_grad()`` or
``torch.inference_mode()`` (the top-k indexers of DeepSeek-V3.2-style sparse attention in
``transformers``) outputs tensors that do not require grad, so no grad reaches its params nor
flows back through them to its inputs. Transforms may then keep such a module whole inside a
module they shard (``tensor_parallel``): computed on the same input on every rank, it gives the
same output, and no grad of it needs summing.

The decorator is read off the function ``torch`` wraps the method in: the context manager
factory its closure holds, through every ``functools.wraps`` layer (``__wrapped__``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["computes_without_grad"]

_GRADLESS = (torch.no_grad, torch.inference_mode)


def computes_without_grad(module: nn.Module) -> bool:
    """Whether ``module``'s ``forward`` is decorated with ``torch.no_grad()`` or
    ``torch.inference_mode()`` (its outputs never require grad).

    Example:
        >>> import torch
        >>> class Indexer(torch.nn.Linear):
        ...     @torch.no_grad()
        ...     def forward(self, x):
        ...         return super().forward(x).topk(1).indices
        >>> computes_without_grad(Indexer(4, 4)), computes_without_grad(torch.nn.Linear(4, 4))
        (True, False)
    """
    function: Callable[..., Any] | None = getattr(type(module), "forward", None)
    while function is not None:
        cells = getattr(function, "__closure__", None) or ()
        for cell in cells:
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(getattr(value, "__self__", value), _GRADLESS):
                return True
        function = getattr(function, "__wrapped__", None)
    return False
