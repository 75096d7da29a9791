"""The dtype a param's grads are summed in over the microbatches of a step that reduces them
once (``shard_params(microbatches=k)``, every ``pipeline`` step): one rule for both paths.

The widest of the stored dtype, the compute dtype (``param_dtype``) and ``reduce_dtype``:
each microbatch's grad (computed in the compute dtype) is widened to it exactly, the sum is
rounded once, to ``reduce_dtype``, for the reduction over ranks, and the reduced grad once
more to the stored dtype. It never rounds more than either of FSDP2's accumulations, in
its reduce dtype (unsharded grads, no gradient sync; its reduce dtype defaults to the compute
dtype) and in the stored one (sharded grads, reduced every microbatch). docs/sharding.md.
"""

from __future__ import annotations

import torch

from ._param_plan import ParamPlan

__all__ = ["accumulated_dtype"]


def accumulated_dtype(entry: ParamPlan) -> torch.dtype:
    """The dtype ``entry``'s microbatch grads are summed in before their one reduction."""
    widest = torch.promote_types(entry.dtype, entry.compute_dtype or entry.dtype)
    return torch.promote_types(widest, entry.reduce_dtype or entry.dtype)
