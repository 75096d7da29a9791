"""``tensor_parallel``: Megatron tensor and sequence parallelism from logical axes; its rule,
its activation layouts and the runtime that moves activations between them."""

from ._layout import ActivationLayout as ActivationLayout
from ._runtime import TensorParallelRuntime as TensorParallelRuntime
from ._transform import DEFAULT_RULES as DEFAULT_RULES
from ._transform import TensorParallel as TensorParallel
from ._transform import tensor_parallel as tensor_parallel

__all__ = [
    "DEFAULT_RULES",
    "ActivationLayout",
    "TensorParallel",
    "TensorParallelRuntime",
    "tensor_parallel",
]
