"""Losses as plain functions of logits and labels (``d9d.losses``)."""

from ._cross_entropy import cross_entropy as cross_entropy

__all__ = ["cross_entropy"]
