"""Every exception d9d raises on purpose; each subclasses the builtin it refines."""

from __future__ import annotations

__all__ = [
    "BatchShapeError",
    "CheckpointCorruptError",
    "CheckpointExistsError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "ConfigError",
    "DataError",
    "DonatedTreeError",
    "DryRunError",
    "IndexRangeError",
    "IndivisibleError",
    "KernelInputError",
    "KernelUnavailableError",
    "LabelError",
    "MeshError",
    "OptimTreeMismatchError",
    "ParamShapeError",
    "ParamTreeMismatchError",
    "PlanError",
    "RankFailedError",
    "RecompileError",
    "UnknownKernelError",
    "UnknownStateNameError",
]


class ParamTreeMismatchError(KeyError):
    """A params tree's paths do not match the model's: lists the missing and unexpected paths."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class ParamShapeError(ValueError):
    """A param's shape differs from the model's or the plan's: names the path and both shapes."""


class DonatedTreeError(RuntimeError):
    """A tree whose buffers were donated to a jitted step was used again, or donated memory is
    shared (two donated leaves, or a donated leaf and an output the step returns elsewhere)."""


class RankFailedError(RuntimeError):
    """A rank started by ``d9d.testing.run_on_ranks`` raised, crashed or timed out."""


class RecompileError(RuntimeError):
    """A jitted step built with ``fail_on_recompile=True`` was traced a second time."""


class DataError(ValueError):
    """A data source, or a loader state to resume from, is missing, empty or malformed."""


class ConfigError(ValueError):
    """A config field is out of range or inconsistent with another field, or a preset is unknown."""


class OptimTreeMismatchError(ValueError):
    """An optimizer's mask, updates or per-param state tree is not laid out like the params
    (or grads): lists the paths."""


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


class LabelError(ValueError):
    """A loss got a label that is neither a class id of the logits nor the ignore index."""


class MeshError(ValueError):
    """A mesh does not fit the world, names an unknown axis, or has no process group."""


class PlanError(ValueError):
    """Transforms conflict, or a param cannot be laid out as asked: names the path and the fix."""


class DryRunError(PlanError):
    """A step cannot run on meta tensors of a simulated world (``d9d plan``'s dry run)."""


class BatchShapeError(ValueError):
    """Ranks pass batches of different shapes or dtypes to one step: names both ranks."""


class IndexRangeError(IndexError):
    """A step's integer input indexes past its table (token ids past the vocab): names it."""


class IndivisibleError(ValueError):
    """A dimension or batch does not divide evenly where it must: names the value and the fix."""


class CheckpointNotFoundError(FileNotFoundError):
    """A path is not a complete checkpoint (missing, still being written, or never committed)."""


class CheckpointExistsError(FileExistsError):
    """A checkpoint of this step is already committed in the directory being saved to."""


class CheckpointMismatchError(ValueError):
    """A restore target does not match the checkpoint: names each path and both shapes/dtypes."""


class CheckpointCorruptError(ValueError):
    """A checkpoint array is missing, truncated or fails its checksum: names the path."""


class CheckpointSaveError(RuntimeError):
    """An asynchronous checkpoint save failed on some rank; nothing was committed."""
