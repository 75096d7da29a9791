"""``fused_linear_cross_entropy``: the LM head and its loss, chunked over tokens.

The full ``[tokens, vocab]`` logits are never materialized: a loop over ``chunk_size`` tokens
computes one chunk's logits with a matmul, overwrites them with their gradient
``softmax - one_hot`` while summing the loss, and turns them at once into that chunk's rows
of the hidden gradient and its share of the weight gradient. Peak extra memory is one
``[chunk_size, vocab]`` logits chunk (plus a float32 copy of it for the ``chunked``
backend) beside the two gradients. Two backends run this loop: ``triton`` (the Triton
cross-entropy kernel, in place on the chunk) and ``chunked`` (plain torch, any device).

The gradients are computed in the forward, unscaled, and scaled in place by
``grad_loss / valid_tokens`` in the backward, so backward does no matmul and allocates
nothing; a second backward through the same graph is refused by autograd's version check.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import KernelInputError
from . import _reference
from ._checks import check_floating, check_same
from ._cross_entropy import check_labels
from ._registry import FLOAT_DTYPES, define_op, register_backend, resolve
from ._triton_env import TRITON_DTYPES, triton_auto, triton_unavailable

__all__ = ["fused_linear_cross_entropy"]

# loss_and_grad_(logits [c, V], labels [c], ignore_index, write_grad) -> per-row loss, float32
# or wider
_ChunkLoss = Callable[[Tensor, Tensor, int, bool], Tensor]


def _loss_dtype(hidden: Tensor) -> torch.dtype:
    """The loss's dtype: float32, or ``hidden``'s when it is wider (float64)."""
    return torch.promote_types(hidden.dtype, torch.float32)


def _torch_loss_and_grad_(
    logits: Tensor, labels: Tensor, ignore_index: int, write_grad: bool
) -> Tensor:
    x = logits.to(_loss_dtype(logits))
    lse = torch.logsumexp(x, dim=-1)
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, 0).long()
    loss = torch.where(valid, lse - x.gather(1, safe_labels[:, None]).squeeze(1), 0.0)
    if write_grad:
        x.sub_(lse[:, None]).exp_()
        x[torch.arange(x.shape[0], device=x.device), safe_labels] -= 1.0
        logits.copy_(x.mul_(valid[:, None]))
    return loss


def _triton_loss_and_grad_(
    logits: Tensor, labels: Tensor, ignore_index: int, write_grad: bool
) -> Tensor:
    from ._triton import cross_entropy as kernels

    if write_grad:
        return kernels.loss_and_grad_(logits, labels, ignore_index)
    return kernels.forward(logits, labels, ignore_index)[0]


def _chunked_loop(
    loss_and_grad_: _ChunkLoss,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int,
    chunk_size: int,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean loss, unscaled grad of hidden, unscaled grad of weight)``; unneeded ones empty."""
    labels = labels.reshape(-1)
    hidden = hidden.reshape(labels.numel(), hidden.shape[-1])  # not -1: ambiguous if hidden 0
    write_grad = need_grad_hidden or need_grad_weight
    loss_sum = torch.zeros((), dtype=_loss_dtype(hidden), device=hidden.device)
    # Contiguous, as the fake says, whatever hidden's strides.
    grad_hidden = hidden.new_empty(hidden.shape) if need_grad_hidden else hidden.new_empty(0)
    # Accumulated in weight's dtype by addmm, which sums in float32 then rounds once per chunk.
    grad_weight = torch.zeros_like(weight) if need_grad_weight else weight.new_empty(0)
    for start in range(0, hidden.shape[0], chunk_size):
        chunk = hidden[start : start + chunk_size]
        logits = chunk @ weight.T
        chunk_labels = labels[start : start + chunk_size]
        loss_sum += loss_and_grad_(logits, chunk_labels, ignore_index, write_grad).sum()
        if need_grad_hidden:
            torch.mm(logits, weight, out=grad_hidden[start : start + chunk_size])
        if need_grad_weight:
            grad_weight.addmm_(logits.T, chunk)
        del logits
    return loss_sum / (labels != ignore_index).sum(), grad_hidden, grad_weight


def _define(backend: str, loss_and_grad_: _ChunkLoss) -> Callable[..., Tensor]:
    """Registers the loop with ``loss_and_grad_`` as custom op ``d9d::flce_<backend>``."""

    @torch.library.custom_op(f"d9d::flce_{backend}", mutates_args=())
    def op(
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        ignore_index: int,
        chunk_size: int,
        need_grad_hidden: bool,
        need_grad_weight: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return _chunked_loop(
            loss_and_grad_,
            hidden,
            weight,
            labels,
            ignore_index,
            chunk_size,
            need_grad_hidden,
            need_grad_weight,
        )

    @op.register_fake
    def _(hidden, weight, labels, ignore_index, chunk_size, need_grad_hidden, need_grad_weight):
        loss = hidden.new_empty((), dtype=_loss_dtype(hidden))
        shape = (hidden.shape[:-1].numel(), hidden.shape[-1]) if need_grad_hidden else (0,)
        grad_weight = torch.empty_like(weight) if need_grad_weight else weight.new_empty(0)
        return loss, hidden.new_empty(shape), grad_weight

    def setup_context(ctx, inputs, output) -> None:
        hidden, _, labels, ignore_index, _, need_grad_hidden, need_grad_weight = inputs
        ctx.save_for_backward(labels, output[1], output[2])
        # The gradients are outputs only to reach the backward: without this, autograd would
        # pass it zeros as large as both of them (doubling the peak memory).
        ctx.set_materialize_grads(False)
        ctx.ignore_index = ignore_index
        ctx.hidden_shape = hidden.shape
        ctx.needs = (need_grad_hidden, need_grad_weight)

    def backward(ctx, grad_loss: Tensor, _grad_hidden: Tensor, _grad_weight: Tensor):
        labels, grad_hidden, grad_weight = ctx.saved_tensors
        # No valid token: the loss is NaN (0 / 0, as torch's) and the grads 0 (as torch's),
        # not 0 * inf.
        scale = grad_loss / (labels != ctx.ignore_index).sum().clamp_min(1)
        need_grad_hidden, need_grad_weight = ctx.needs
        grad_hidden = grad_hidden.mul_(scale).view(ctx.hidden_shape) if need_grad_hidden else None
        grad_weight = grad_weight.mul_(scale) if need_grad_weight else None
        return grad_hidden, grad_weight, None, None, None, None, None

    op.register_autograd(backward, setup_context=setup_context)

    def impl(
        hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_size: int
    ) -> Tensor:
        grad_enabled = torch.is_grad_enabled()
        need_grad_hidden = grad_enabled and hidden.requires_grad
        need_grad_weight = grad_enabled and weight.requires_grad
        return op(
            hidden, weight, labels, ignore_index, chunk_size, need_grad_hidden, need_grad_weight
        )[0]

    return impl


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int = -100,
    *,
    chunk_size: int = 1024,
    backend: str | None = None,
) -> Tensor:
    """``cross_entropy(hidden @ weight.T, labels, ignore_index)`` without the full logits.

    Peak extra memory is one ``[chunk_size, vocab]`` chunk of logits (the ``triton`` and
    ``chunked`` backends) instead of ``[tokens, vocab]`` (the ``reference``). The gradients
    of ``hidden`` and ``weight`` that autograd will need (those that require grad, with grad
    mode on) are computed chunk by chunk during the forward, so a backward costs no matmul;
    a frozen head (``weight.requires_grad=False``) costs no ``[vocab, hidden]`` buffer.

    Args:
        hidden: ``[..., hidden]`` float tensor (the final norm's output).
        weight: ``[vocab, hidden]`` tensor of ``hidden``'s dtype (the LM head's weight).
        labels: integer tensor of shape ``hidden.shape[:-1]``.
        ignore_index: label value whose tokens are left out of loss and mean; default -100.
        chunk_size: tokens per chunk; default 1024 (262 MB of bf16 logits at vocab 128256).
        backend: ``"reference"``, ``"triton"``, ``"chunked"``, ``"auto"`` or None.

    Returns:
        The mean loss over valid tokens, a 0-d float32 tensor (float64 for float64 inputs,
        which every backend that takes them computes in); NaN with zero grads when every
        label is ignored, as in ``torch``.

    Raises:
        KernelInputError: bad dtypes, shapes, devices, an empty vocab, or ``chunk_size`` < 1.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d.kernels as K
        >>> hidden, weight = torch.zeros(3, 8), torch.zeros(16, 8)
        >>> K.fused_linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 3]), chunk_size=2)
        tensor(2.7726)
    """
    op = "fused_linear_cross_entropy"
    check_floating(op, hidden=hidden, weight=weight)
    check_same(op, "dtype", hidden=hidden, weight=weight)
    check_same(op, "device", hidden=hidden, weight=weight, labels=labels)
    if hidden.dim() == 0 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise KernelInputError(
            f"{op}: expected hidden [..., hidden] and weight [vocab, hidden], "
            f"got {hidden.shape=}, {weight.shape=}"
        )
    if weight.shape[0] == 0:
        raise KernelInputError(
            f"{op}: {weight.shape=} has an empty vocab: a softmax over no class has no "
            "probability; give weight at least one row"
        )
    check_labels(op, labels, tuple(hidden.shape[:-1]))
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise KernelInputError(f"{op}: {chunk_size=} must be a positive int")
    return resolve(op, hidden, backend)(hidden, weight, labels, ignore_index, chunk_size)


define_op("fused_linear_cross_entropy", _reference.fused_linear_cross_entropy)
register_backend(
    "fused_linear_cross_entropy",
    "chunked",
    _define("chunked", _torch_loss_and_grad_),
    dtypes=FLOAT_DTYPES,
)
register_backend(
    "fused_linear_cross_entropy",
    "triton",
    _define("triton", _triton_loss_and_grad_),
    dtypes=TRITON_DTYPES,
    unavailable=triton_unavailable,
    auto=triton_auto,
)
