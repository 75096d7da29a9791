"""Every exception d9d raises on purpose; each subclasses the builtin it refines."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DataError",
    "DonatedTreeError",
    "KernelInputError",
    "KernelUnavailableError",
    "OptimTreeMismatchError",
    "ParamTreeMismatchError",
    "RankFailedError",
    "RecompileError",
    "UnknownKernelError",
    "UnknownStateNameError",
]


class ParamTreeMismatchError(KeyError):
    """A params tree's paths do not match the model's: lists the missing and unexpected paths."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class DonatedTreeError(RuntimeError):
    """A tree whose buffers were donated to a jitted step was used again."""


class RankFailedError(RuntimeError):
    """A rank started by ``d9d.testing.run_on_ranks`` raised, crashed or timed out."""


class RecompileError(RuntimeError):
    """A jitted step built with ``fail_on_recompile=True`` was traced a second time."""


class DataError(ValueError):
    """A data source, or a loader state to resume from, is missing, empty or malformed."""


class ConfigError(ValueError):
    """A config field is out of range or inconsistent with another field, or a preset is unknown."""


class OptimTreeMismatchError(ValueError):
    """An optimizer's mask or updates tree is not laid out like the params: lists the paths."""


class UnknownStateNameError(KeyError):
    """``d9d.optim.get_state`` was asked for a name no state has: lists the names there are."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class KernelInputError(ValueError):
    """A ``d9d.kernels`` op got tensors of the wrong dtype, shape or device."""


class KernelUnavailableError(RuntimeError):
    """A ``d9d.kernels`` backend was forced that cannot run here: says why and what can."""


class UnknownKernelError(ValueError):
    """A ``d9d.kernels`` op or backend name is not registered: lists the names there are."""
