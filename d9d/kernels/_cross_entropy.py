"""``cross_entropy``: the public op and its Triton backend as custom ops."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import KernelInputError
from . import _reference
from ._checks import check_floating, check_same, check_shape
from ._registry import define_op, register_backend, resolve
from ._triton_env import TRITON_DTYPES, triton_auto, triton_unavailable

__all__ = ["check_labels", "cross_entropy"]


@torch.library.custom_op("d9d::cross_entropy_triton", mutates_args=())
def _forward(logits: Tensor, labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """``(mean loss over valid rows, per-row logsumexp)``, both float32."""
    from ._triton import cross_entropy as kernels

    vocab = logits.shape[-1]
    loss, lse = kernels.forward(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index)
    return loss.sum() / (labels != ignore_index).sum(), lse.view(labels.shape)


@_forward.register_fake
def _(logits: Tensor, labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    return logits.new_empty((), dtype=torch.float32), logits.new_empty(
        labels.shape, dtype=torch.float32
    )


@torch.library.custom_op("d9d::cross_entropy_triton_backward", mutates_args=())
def _backward(
    grad_loss: Tensor, logits: Tensor, labels: Tensor, lse: Tensor, ignore_index: int
) -> Tensor:
    from ._triton import cross_entropy as kernels

    vocab = logits.shape[-1]
    scale = grad_loss / (labels != ignore_index).sum()
    grad = kernels.backward(
        logits.reshape(-1, vocab), labels.reshape(-1), lse.reshape(-1), scale, ignore_index
    )
    return grad.view(logits.shape)


@_backward.register_fake
def _(grad_loss: Tensor, logits: Tensor, labels: Tensor, lse: Tensor, ignore_index: int) -> Tensor:
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    logits, labels, ignore_index = inputs
    ctx.save_for_backward(logits, labels, output[1])
    ctx.ignore_index = ignore_index


def _autograd_backward(ctx, grad_loss: Tensor, grad_lse: Tensor):
    logits, labels, lse = ctx.saved_tensors
    return _backward(grad_loss, logits, labels, lse, ctx.ignore_index), None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def _triton_cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
    return _forward(logits, labels, ignore_index)[0]


def check_labels(op: str, labels: Tensor, expected_shape: tuple[int, ...]) -> None:
    """Raises unless ``labels`` is an integer tensor of ``expected_shape``."""
    if not isinstance(labels, Tensor) or labels.is_floating_point() or labels.is_complex():
        got = labels.dtype if isinstance(labels, Tensor) else type(labels)
        raise KernelInputError(f"{op}: labels must be an integer tensor, got {got}")
    if labels.dtype == torch.bool:
        raise KernelInputError(f"{op}: labels must be an integer tensor, got {labels.dtype}")
    check_shape(op, "labels", labels, expected_shape)


def cross_entropy(
    logits: Tensor, labels: Tensor, ignore_index: int = -100, *, backend: str | None = None
) -> Tensor:
    """Softmax cross-entropy, averaged over the tokens whose label is not ``ignore_index``.

    The Triton backend never makes a float32 copy of the logits (it reads them once in their
    dtype with an online softmax) and writes their gradient in their dtype. A label outside
    ``[0, vocab)`` other than ``ignore_index`` makes the loss NaN (Triton) or raises
    (reference). With every label ignored the loss is NaN, as in ``torch``.

    Args:
        logits: ``[..., vocab]`` float tensor.
        labels: integer tensor of shape ``logits.shape[:-1]``.
        ignore_index: label value whose tokens are left out of loss and mean; default -100.
        backend: ``"reference"``, ``"triton"``, ``"auto"`` or None (see ``d9d.kernels.use``).

    Returns:
        The mean loss, a 0-d float32 tensor, differentiable in ``logits``.

    Raises:
        KernelInputError: non-float logits, non-integer labels, mismatched shapes or devices,
            an empty vocab (``logits.shape[-1] == 0``).
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d.kernels as K
        >>> K.cross_entropy(torch.zeros(2, 4), torch.tensor([1, -100]))
        tensor(1.3863)
    """
    check_floating("cross_entropy", logits=logits)
    if logits.dim() == 0:
        raise KernelInputError(f"cross_entropy: logits must be [..., vocab], got {logits.shape=}")
    if logits.shape[-1] == 0:
        raise KernelInputError(
            f"cross_entropy: {logits.shape=} has an empty vocab: a softmax over no class has "
            "no probability; give logits at least one class"
        )
    check_labels("cross_entropy", labels, tuple(logits.shape[:-1]))
    check_same("cross_entropy", "device", logits=logits, labels=labels)
    return resolve("cross_entropy", logits, backend)(logits, labels, ignore_index)


define_op("cross_entropy", _reference.cross_entropy)
register_backend(
    "cross_entropy",
    "triton",
    _triton_cross_entropy,
    dtypes=TRITON_DTYPES,
    unavailable=triton_unavailable,
    auto=triton_auto,
)
