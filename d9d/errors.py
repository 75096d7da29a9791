"""Every exception d9d raises on purpose; each subclasses the builtin it refines."""

from __future__ import annotations

__all__ = [
    "DataError",
    "DonatedTreeError",
    "ParamTreeMismatchError",
    "RecompileError",
]


class ParamTreeMismatchError(KeyError):
    """A params tree's paths do not match the model's: lists the missing and unexpected paths."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class DonatedTreeError(RuntimeError):
    """A tree whose buffers were donated to a jitted step was used again."""


class RecompileError(RuntimeError):
    """A jitted step built with ``fail_on_recompile=True`` was traced a second time."""


class DataError(ValueError):
    """A data source is missing, empty or malformed."""
