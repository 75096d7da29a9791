"""Modules that may draw random numbers in training: dropout, router jitter.

Found once per model structure (``Structure.drawing``), so that a transform that cannot
split the draws between its ranks (``tensor_parallel``) reads only these modules' training
flag and rate at each step, not every module's. A module counts when it is a ``_DropoutNd``
(``nn.Dropout``, ``Dropout1d``..``3d``, ``AlphaDropout``) or holds one of
:data:`DRAWN_ATTRIBUTES` in its ``__dict__``, whatever its value when the structure is read:
a rate of 0 set above 0 later, or a module put back in training mode, is still seen.
"""

from __future__ import annotations

from torch import nn

__all__ = ["DRAWN_ATTRIBUTES", "may_draw"]

# Attributes modules keep for a functional draw (``F.dropout(x, self.<name>)``, SDPA's
# ``dropout_p``, a Mixtral-style router's ``jitter_noise``).
DRAWN_ATTRIBUTES = ("attention_dropout", "dropout", "dropout_p", "jitter_noise")


def may_draw(module: nn.Module) -> bool:
    """Whether ``module`` is a dropout module or keeps a rate in :data:`DRAWN_ATTRIBUTES`.

    Example:
        >>> from torch import nn
        >>> attention = nn.Module()
        >>> attention.attention_dropout = 0.0
        >>> may_draw(nn.Dropout(0.0)), may_draw(attention), may_draw(nn.Linear(2, 2))
        (True, True, False)
    """
    return isinstance(module, nn.modules.dropout._DropoutNd) or any(
        name in module.__dict__ for name in DRAWN_ATTRIBUTES
    )
