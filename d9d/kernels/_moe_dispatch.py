"""``dispatch`` / ``combine``: expert parallelism's token exchange, DeepEP-style.

A layout from the top-k ids (:func:`dispatch_layout`, local), then :func:`dispatch`, which
sends each token once to every ep rank owning one of its experts and returns the received
tokens as rows grouped by local expert (what ``grouped_gemm`` takes) with a handle, and
:func:`combine`, which weights the rows' outputs, sums them per token on the receiving rank
and sends one row per token back, where the source sums its ranks' rows. Backends: ``c10d``
(uneven all-to-alls) and ``reference`` (all-gathers and a reduce-scatter, the oracle).
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed import ProcessGroup

from ..errors import KernelInputError
from ._checks import check_floating, check_same
from ._moe_dispatch_c10d import combine_c10d, dispatch_c10d
from ._moe_dispatch_layout import DispatchGroup, DispatchHandle, DispatchLayout
from ._moe_dispatch_reference import combine_reference, dispatch_reference
from ._registry import FLOAT_DTYPES, define_op, register_backend, resolve

__all__ = ["combine", "dispatch"]


def dispatch(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    layout: DispatchLayout,
    group: ProcessGroup | DispatchGroup,
    *,
    backend: str | None = None,
) -> tuple[Tensor, Tensor, DispatchHandle]:
    """Sends each token to the ep ranks that own its experts, once per rank.

    Rank ``j`` of ``group`` (``R`` ranks) owns experts ``j*L .. (j+1)*L - 1`` (``L = E /
    R``). Each rank receives the tokens of every rank (its own included) that chose one of
    its experts, and returns them as one row per choice of a local expert, grouped by local
    expert, then by source rank and token, then by choice. Reads the split sizes on the host
    (one all-to-all of counts; meta tensors assume uniform routing, ``docs/moe.md``).
    Differentiable in ``x`` and ``topk_weights``: the backward is a combine of the grads.
    Every rank of ``group`` must call it.

    Args:
        x: ``[T, dim]`` float tensor of this rank's tokens.
        topk_ids: ``[T, k]`` integer tensor, each token's experts (global ids).
        topk_weights: ``[T, k]`` float tensor, their routing weights (applied by
            :func:`combine`).
        layout: :func:`dispatch_layout` of ``topk_ids`` for this group's size.
        group: The ep process group (``mesh.get_group("ep")``), or its
            :class:`DispatchGroup` (what a traced step passes).
        backend: ``"c10d"``, ``"reference"``, ``"auto"`` or None (see ``d9d.kernels.use``).

    Returns:
        ``(rows [M, dim], group_sizes [L] int32, handle)``: the rows for the local experts,
        their count per local expert, and the :class:`DispatchHandle` :func:`combine` takes.

    Raises:
        KernelInputError: wrong shapes, dtypes or devices, or a layout of another group size.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d, d9d.kernels as K, torch
        >>> from d9d.testing import run_on_ranks
        >>> def rank_fn():
        ...     group = d9d.make_mesh("cpu", ep=2).get_group("ep")
        ...     x, ids = torch.ones(3, 4), torch.tensor([[0, 1], [2, 3], [1, 2]])
        ...     layout = K.dispatch_layout(ids, 4, 2)
        ...     rows, sizes, handle = K.dispatch(x, ids, torch.full((3, 2), 0.5), layout, group)
        ...     return sizes.tolist(), K.combine(2 * rows, handle).sum().item()
        >>> run_on_ranks(rank_fn, 2)
        [([2, 4], 24.0), ([4, 2], 24.0)]
    """
    check_floating("dispatch", x=x, topk_weights=topk_weights)
    check_same("dispatch", "device", x=x, topk_ids=topk_ids, topk_weights=topk_weights)
    tokens = x.shape[0] if x.dim() == 2 else None
    if tokens is None or topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise KernelInputError(
            f"dispatch: x must be [T, dim] and topk_ids [T, k], got {x.shape=}, {topk_ids.shape=}"
        )
    if topk_weights.shape != topk_ids.shape:
        raise KernelInputError(
            f"dispatch: topk_weights must be shaped like topk_ids, got {topk_weights.shape=}, "
            f"{topk_ids.shape=}"
        )
    group = DispatchGroup.of(group)
    if layout.token_in_rank.shape != (tokens, group.size):
        raise KernelInputError(
            f"dispatch: the layout is of {tuple(layout.token_in_rank.shape)} (tokens, ranks), "
            f"the call of {tokens} tokens on a group of {group.size} ranks: build it with "
            f"dispatch_layout(topk_ids, num_experts, {group.size})"
        )
    return resolve("dispatch", x, backend)(x, topk_ids, topk_weights, layout, group)


def combine(outputs: Tensor, handle: DispatchHandle, *, backend: str | None = None) -> Tensor:
    """The rows' outputs weighted, summed per token and sent back to the tokens' ranks.

    The receiving rank sums each token's local experts' outputs times their weights (in
    float32 or wider, cast once), sends one row per token back, and the source sums its
    ranks' rows. Runs the backend that made ``handle``. Differentiable in ``outputs`` and
    (through the handle) the dispatched ``x`` and ``topk_weights``; the backward is a
    dispatch of the grads. Every rank of the group must call it.

    Args:
        outputs: ``[M, dim']`` float tensor, the local experts' outputs of the rows
            :func:`dispatch` returned, in their order.
        handle: What :func:`dispatch` returned with them.
        backend: None (the handle's) or the handle's backend name.

    Returns:
        ``[T, dim']`` tensor of ``outputs``' dtype: each token's weighted sum over its experts.

    Raises:
        KernelInputError: ``outputs`` has another row count, or ``backend`` is not the
            handle's.

    Example:
        >>> import d9d, d9d.kernels as K, torch
        >>> from d9d.testing import run_on_ranks
        >>> def rank_fn():
        ...     group = d9d.make_mesh("cpu", ep=2).get_group("ep")
        ...     ids = torch.tensor([[0, 3], [1, 2]])  # experts 0, 1 on rank 0; 2, 3 on rank 1
        ...     x = torch.full((2, 1), 1.0 + torch.distributed.get_rank())
        ...     layout = K.dispatch_layout(ids, 4, 2)
        ...     rows, _, handle = K.dispatch(x, ids, torch.full((2, 2), 0.5), layout, group)
        ...     return K.combine(10 * rows, handle).flatten().tolist()  # mean over 2 experts
        >>> run_on_ranks(rank_fn, 2)
        [[10.0, 10.0], [20.0, 20.0]]
    """
    check_floating("combine", outputs=outputs)
    rows = handle.row_token.shape[0]
    if outputs.dim() != 2 or outputs.shape[0] != rows:
        raise KernelInputError(
            f"combine: outputs must be [{rows}, dim'] (a row per dispatched row), got "
            f"{outputs.shape=}"
        )
    if backend not in (None, handle.backend):
        raise KernelInputError(
            f"combine: {backend=}, but the handle comes from the {handle.backend!r} dispatch: "
            f"combine runs the backend that dispatched (force both with d9d.kernels.use("
            f"dispatch=...))"
        )
    return resolve("combine", outputs, handle.backend)(outputs, handle)


define_op("dispatch", dispatch_reference)
define_op("combine", combine_reference)
for _op, _impl in (("dispatch", dispatch_c10d), ("combine", combine_c10d)):
    register_backend(_op, "c10d", _impl, dtypes=FLOAT_DTYPES)
