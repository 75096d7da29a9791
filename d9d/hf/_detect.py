"""Whether a module is a ``transformers`` model, read from its classes' module names (so that
``import d9d`` never imports ``transformers``)."""

from __future__ import annotations

from torch import nn

__all__ = ["is_hf_model"]

_TRANSFORMERS = "transformers."


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` model (or a subclass of one).

    Example:
        >>> is_hf_model(nn.Linear(2, 2))
        False
    """
    return any(cls.__module__.startswith(_TRANSFORMERS) for cls in type(module).__mro__)
