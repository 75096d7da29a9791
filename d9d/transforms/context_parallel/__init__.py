"""``context_parallel``: every sequence split over a mesh axis, attention as ring attention;
its rule, the sequence split and the runtime."""

from ._runtime import ContextParallelRuntime as ContextParallelRuntime
from ._split import SequenceSplit as SequenceSplit
from ._transform import ContextParallel as ContextParallel
from ._transform import context_parallel as context_parallel

__all__ = ["ContextParallel", "ContextParallelRuntime", "SequenceSplit", "context_parallel"]
