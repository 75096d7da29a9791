"""What ``remat`` keeps of a block's forward: its inputs only (``"full"``), or also the
outputs of its matmuls, attention and reduce-scatters (``"selective"``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["POLICIES", "SAVED_OPS", "selective_contexts"]

POLICIES = ("full", "selective")

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

SAVED_OPS = tuple(
    op
    for op in (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        getattr(_aten, "_scaled_dot_product_flash_attention", None),
        getattr(_aten, "_scaled_dot_product_efficient_attention", None),
        getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
        getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
        _c10d.reduce_scatter_tensor.default,
    )
    if op is not None
)
"""Ops whose outputs ``"selective"`` keeps; everything else in the block is recomputed
(elementwise ops, norms, the gathers of params and activations)."""

_SAVED = frozenset(
    op.default if isinstance(op, torch._ops.OpOverloadPacket) else op for op in SAVED_OPS
)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[Any, Any]:
    """``(forward context, recompute context)`` of the ``"selective"`` policy."""
    return create_selective_checkpoint_contexts(_policy)
