"""What ``remat`` keeps of a block's forward: its inputs only (``"full"``), or also the
outputs of its matmuls, attention, reduce-scatters and all-to-alls (``"selective"``).

Under ``d9d.jit`` the recomputation is not a second eager forward but nodes duplicated into
the backward part of the one compiled graph, and torch duplicates no op that draws a random
seed (attention ops carry that tag, dropout or not): there ``"full"`` keeps the attention
outputs as well (:func:`compiled_contexts`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["POLICIES", "SAVED_OPS", "compiled_contexts", "selective_contexts"]

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
        # Expert parallelism's dispatch and combine (and the count exchange before them):
        # recomputed, a block would run its five forward all-to-alls again in the backward
        # (counted: 8 all-to-alls a step at ep=2 without remat, 13 with); context
        # parallelism's ring exchanges are kept alike.
        _c10d.all_to_all_single.default,
    )
    if op is not None
)
"""Ops whose outputs ``"selective"`` keeps; everything else in the block is recomputed
(elementwise ops, norms, the gathers of params and activations)."""

_SAVED = frozenset(
    op.default if isinstance(op, torch._ops.OpOverloadPacket) else op for op in SAVED_OPS
)


def _selective(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def _seeded(op: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def _full_compiled(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if _seeded(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_compiled(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    del ctx, args, kwargs
    keep = op in _SAVED or _seeded(op)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[Any, Any]:
    """``(forward context, recompute context)`` of the ``"selective"`` policy, eager."""
    return create_selective_checkpoint_contexts(_selective)


def compiled_contexts(policy: str) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` of ``policy`` for a checkpoint traced by ``d9d.jit``: what the
    compiled graph keeps (ops that draw a seed always, as torch cannot duplicate them)."""
    chosen = _selective_compiled if policy == "selective" else _full_compiled
    return functools.partial(create_selective_checkpoint_contexts, chosen)
