"""``moe_permute`` / ``moe_unpermute``: tokens to expert-grouped rows and back, weighted.

Routing (which row each choice goes to) is computed once, on the device, with torch ops and
no host sync; the backends differ only in how they move rows. The Triton backend is two
custom ops, ``scatter`` and ``gather_sum``, each the other's backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import KernelInputError
from ._checks import check_floating, check_same
from ._registry import FLOAT_DTYPES, define_op, register_backend, resolve
from ._triton_env import TRITON_DTYPES, triton_auto, triton_unavailable

__all__ = ["moe_permute", "moe_unpermute"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def route(expert_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """``(row_map [T, k] int64, group_sizes [E] int32)``: a stable sort of the choices by expert."""
    flat = expert_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    positions = torch.arange(flat.numel(), device=flat.device)
    row_map = torch.empty_like(order).scatter_(0, order, positions)
    ones = torch.ones_like(flat, dtype=torch.int32)
    group_sizes = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    return row_map.view(expert_ids.shape), group_sizes.scatter_add_(0, flat, ones)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def permute_reference(x: Tensor, expert_ids: Tensor, num_experts: int) -> tuple[Tensor, ...]:
    """``x`` indexed by each permuted row's source token (autograd sums the copies back)."""
    row_map, group_sizes = route(expert_ids, num_experts)
    flat = row_map.reshape(-1)
    choice = torch.empty_like(flat).scatter_(0, flat, torch.arange(flat.numel(), device=x.device))
    return x.index_select(0, choice // row_map.shape[1]), group_sizes, row_map


def unpermute_reference(permuted_out: Tensor, row_map: Tensor, weights: Tensor) -> Tensor:
    """``sum_j weights[t, j] * permuted_out[row_map[t, j]]`` in float32, cast once."""
    wide = _wide(permuted_out.dtype)
    gathered = permuted_out[row_map].to(wide)  # [T, k, H]
    return (gathered * weights.to(wide)[..., None]).sum(1).to(permuted_out.dtype)


def _unpermute_embedding_bag(permuted_out: Tensor, row_map: Tensor, weights: Tensor) -> Tensor:
    """The reference's sum as one ``embedding_bag``: each token a bag of its ``top_k`` rows.

    It reads each row once and writes each token once, where the reference materializes the
    ``[T, top_k, H]`` gather; its backward is a scatter of the weighted gradient rows.
    """
    if permuted_out.shape[1] == 0 or row_map.shape[1] == 0:  # embedding_bag refuses these
        return unpermute_reference(permuted_out, row_map, weights)
    wide = _wide(permuted_out.dtype)
    bags = F.embedding_bag(
        row_map, permuted_out.to(wide), per_sample_weights=weights.to(wide), mode="sum"
    )
    return bags.to(permuted_out.dtype)


@torch.library.custom_op("d9d::moe_scatter_triton", mutates_args=())
def _scatter(x: Tensor, row_map: Tensor, weights: Tensor | None) -> Tensor:
    from ._triton import moe_permute as kernels

    return kernels.scatter(x, row_map, weights)


@_scatter.register_fake
def _(x: Tensor, row_map: Tensor, weights: Tensor | None) -> Tensor:
    return x.new_empty(row_map.numel(), x.shape[1])


@torch.library.custom_op("d9d::moe_gather_sum_triton", mutates_args=())
def _gather_sum(y: Tensor, row_map: Tensor, weights: Tensor | None) -> Tensor:
    from ._triton import moe_permute as kernels

    return kernels.gather_sum(y, row_map, weights)


@_gather_sum.register_fake
def _(y: Tensor, row_map: Tensor, weights: Tensor | None) -> Tensor:
    return y.new_empty(row_map.shape[0], y.shape[1])


@torch.library.custom_op("d9d::moe_choice_dot_triton", mutates_args=())
def _choice_dot(a: Tensor, b: Tensor, row_map: Tensor, like: Tensor) -> Tensor:
    """``[T, k]`` in ``like``'s dtype: ``<a[t], b[row_map[t, j]]>``."""
    from ._triton import moe_permute as kernels

    return kernels.choice_dot(a, b, row_map, like.dtype)


@_choice_dot.register_fake
def _(a: Tensor, b: Tensor, row_map: Tensor, like: Tensor) -> Tensor:
    return torch.empty_like(like, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _scatter_backward(ctx, grad: Tensor):
    x, row_map, weights = ctx.saved_tensors
    dx = _gather_sum(grad, row_map, weights) if ctx.needs_input_grad[0] else None
    dw = _choice_dot(x, grad, row_map, weights) if ctx.needs_input_grad[2] else None
    return dx, None, dw


def _gather_sum_backward(ctx, grad: Tensor):
    y, row_map, weights = ctx.saved_tensors
    dy = _scatter(grad, row_map, weights) if ctx.needs_input_grad[0] else None
    dw = _choice_dot(grad, y, row_map, weights) if ctx.needs_input_grad[2] else None
    return dy, None, dw


_scatter.register_autograd(_scatter_backward, setup_context=_setup_context)
_gather_sum.register_autograd(_gather_sum_backward, setup_context=_setup_context)


def _permute_triton(x: Tensor, expert_ids: Tensor, num_experts: int) -> tuple[Tensor, ...]:
    row_map, group_sizes = route(expert_ids, num_experts)
    return _scatter(x, row_map, None), group_sizes, row_map


def _unpermute_triton(permuted_out: Tensor, row_map: Tensor, weights: Tensor) -> Tensor:
    return _gather_sum(permuted_out, row_map, weights)


def _check_ids(op: str, name: str, ids: Tensor) -> None:
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype not in _INDEX_DTYPES:
        got = f"{ids.shape=}, {ids.dtype=}" if isinstance(ids, Tensor) else f"{type(ids)}"
        raise KernelInputError(
            f"{op}: {name} must be an int32 or int64 tensor [T, top_k], got {got}"
        )


def moe_permute(
    x: Tensor, expert_ids: Tensor, num_experts: int, *, backend: str | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Copies each token once per chosen expert, into rows grouped by expert (dropless).

    Choices are ordered by expert, then by token, then by choice (a stable sort), so the
    result feeds ``grouped_gemm`` directly. Runs on the device with no host sync: the number
    of rows is ``T * top_k`` whatever the routing. Ids outside ``[0, num_experts)`` are not
    checked (a check would sync) and give undefined results. Differentiable in ``x``.

    Args:
        x: ``[T, H]`` float tensor of tokens.
        expert_ids: ``[T, top_k]`` integer tensor on ``x``'s device, the experts of each token.
        num_experts: ``E``, the number of experts (> 0).
        backend: ``"triton"``, ``"reference"``, ``"auto"`` or None (see ``d9d.kernels.use``).

    Returns:
        ``(permuted [T*top_k, H] of x's dtype, group_sizes [E] int32, row_map [T, top_k]
        int64)``: ``permuted[row_map[t, j]] == x[t]`` is token ``t``'s copy for its ``j``-th
        expert, and ``group_sizes[e]`` counts expert ``e``'s rows.

    Raises:
        KernelInputError: wrong shapes, dtypes or devices, or ``num_experts < 1``.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d.kernels as K
        >>> x = torch.tensor([[1.0], [2.0], [3.0]])
        >>> permuted, sizes, row_map = K.moe_permute(x, torch.tensor([[1], [0], [1]]), 2)
        >>> permuted.flatten().tolist(), sizes.tolist(), row_map.flatten().tolist()
        ([2.0, 1.0, 3.0], [1, 2], [1, 0, 2])
    """
    check_floating("moe_permute", x=x)
    _check_ids("moe_permute", "expert_ids", expert_ids)
    check_same("moe_permute", "device", x=x, expert_ids=expert_ids)
    if x.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise KernelInputError(
            f"moe_permute: x must be [T, H] and expert_ids [T, top_k], got {x.shape=}, "
            f"{expert_ids.shape=}"
        )
    if not isinstance(num_experts, int) or num_experts < 1:
        raise KernelInputError(f"moe_permute: {num_experts=} must be a positive int")
    return resolve("moe_permute", x, backend)(x, expert_ids, num_experts)


def moe_unpermute(
    permuted_out: Tensor, row_map: Tensor, weights: Tensor, *, backend: str | None = None
) -> Tensor:
    """Sums each token's expert outputs back in token order, weighted by its routing weights.

    ``out[t] = sum_j weights[t, j] * permuted_out[row_map[t, j]]``, computed in float32 and
    cast to ``permuted_out``'s dtype. Differentiable in ``permuted_out`` and ``weights``.

    Args:
        permuted_out: ``[T*top_k, H']`` float tensor, the expert outputs in permuted order.
        row_map: ``[T, top_k]`` integer tensor, as returned by :func:`moe_permute`.
        weights: ``[T, top_k]`` float tensor (any float dtype), the routing weights.
        backend: ``"triton"``, ``"torch"`` (one ``embedding_bag``), ``"reference"``,
            ``"auto"`` or None (see ``d9d.kernels.use``).

    Returns:
        ``[T, H']`` tensor of ``permuted_out``'s dtype.

    Raises:
        KernelInputError: wrong shapes, dtypes or devices.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d.kernels as K
        >>> y = torch.tensor([[10.0], [20.0], [30.0]])
        >>> row_map, weights = torch.tensor([[1], [0], [2]]), torch.tensor([[0.5], [1.0], [2.0]])
        >>> K.moe_unpermute(y, row_map, weights).flatten().tolist()
        [10.0, 10.0, 60.0]
    """
    check_floating("moe_unpermute", permuted_out=permuted_out, weights=weights)
    _check_ids("moe_unpermute", "row_map", row_map)
    check_same(
        "moe_unpermute", "device", permuted_out=permuted_out, row_map=row_map, weights=weights
    )
    if (
        permuted_out.dim() != 2
        or weights.shape != row_map.shape
        or permuted_out.shape[0] != row_map.numel()
    ):
        raise KernelInputError(
            f"moe_unpermute: permuted_out must be [T*top_k, H] and row_map and weights "
            f"[T, top_k], got {permuted_out.shape=}, {row_map.shape=}, {weights.shape=}"
        )
    return resolve("moe_unpermute", permuted_out, backend)(permuted_out, row_map, weights)


define_op("moe_permute", permute_reference)
define_op("moe_unpermute", unpermute_reference)
register_backend("moe_unpermute", "torch", _unpermute_embedding_bag, dtypes=FLOAT_DTYPES)
for _op, _impl in (("moe_permute", _permute_triton), ("moe_unpermute", _unpermute_triton)):
    register_backend(
        _op, "triton", _impl, dtypes=TRITON_DTYPES, unavailable=triton_unavailable, auto=triton_auto
    )
