"""Losses as plain functions of logits and labels (``d9d.losses``)."""

from ._cross_entropy import cross_entropy as cross_entropy
from ._token_mean import token_mean as token_mean

__all__ = ["cross_entropy", "token_mean"]
