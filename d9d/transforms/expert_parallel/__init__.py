"""``expert_parallel``: routed experts sharded over a mesh axis; its runtime puts dispatch,
the local experts and combine (``d9d.kernels``' all-to-all ops) in place of each MoE layer's
``dispatch`` and of each Hugging Face experts module's call."""

from ._runtime import ExpertParallelRuntime as ExpertParallelRuntime
from ._transform import ExpertParallel as ExpertParallel
from ._transform import expert_parallel as expert_parallel
from ._transform import is_expert_weight as is_expert_weight

__all__ = ["ExpertParallel", "ExpertParallelRuntime", "expert_parallel", "is_expert_weight"]
