"""``grouped_gemm``: one matmul per expert over its contiguous rows; reference, ``torch``
(``torch._grouped_mm``) and Triton backends, the latter two as custom ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import KernelInputError
from ._checks import check_floating, check_same
from ._registry import define_op, register_backend, resolve
from ._triton_env import TRITON_DTYPES, triton_auto, triton_unavailable

__all__ = ["grouped_gemm"]


def reference(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    """A loop over experts, each a full ``x @ w[e]`` masked to its rows: no host sync.

    It does ``E`` times the work of the grouped product, in float32 (float64 stays float64).
    Its input is masked too, so that the gradients, like the product, see only each expert's
    rows: unmasked, a NaN in one row of ``x`` made every expert's weight gradient NaN
    (``0 * NaN`` in ``x.T @ grad``), and one in ``w[e]`` every row's input gradient.
    """
    wide = torch.promote_types(x.dtype, torch.float32)
    ends = group_sizes.cumsum(0)
    rows = torch.arange(x.shape[0], device=x.device)
    x_wide, out = x.to(wide), x.new_zeros(x.shape[0], w.shape[2], dtype=wide)
    for e in range(w.shape[0]):
        mine = (rows >= ends[e] - group_sizes[e]) & (rows < ends[e])
        x_mine = torch.where(mine[:, None], x_wide, 0.0)
        out = out + torch.where(mine[:, None], x_mine @ w[e].to(wide), 0.0)
    return out.to(x.dtype)


def _pad(t: Tensor, dims: tuple[int, ...]) -> Tensor:
    """``t`` contiguous, zero-padded at the end of ``dims`` to 16-byte multiples: the strides
    ``_grouped_mm`` accepts."""
    t, multiple = t.contiguous(), 16 // t.element_size()
    pad = [0] * (2 * t.dim())
    for dim in dims:
        pad[2 * (t.dim() - 1 - dim) + 1] = -t.shape[dim] % multiple
    return F.pad(t, pad) if any(pad) else t


def _contiguous_like(t: Tensor) -> Tensor:
    """A fake gradient as the backends return it: contiguous whatever ``t``'s strides (a
    fake of ``t``'s strides failed inductor's stride assert for a column-major ``x``)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _offsets(group_sizes: Tensor) -> Tensor:
    return group_sizes.cumsum(0, dtype=torch.int32)


@torch.library.custom_op("d9d::grouped_gemm_torch", mutates_args=())
def _torch_forward(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    if x.shape[1] == 0 or w.shape[2] == 0:  # _grouped_mm refuses an empty K or N's strides
        return x.new_zeros(x.shape[0], w.shape[2])
    out = torch._grouped_mm(_pad(x, (1,)), _pad(w, (1, 2)), offs=_offsets(group_sizes))
    return out[:, : w.shape[2]].contiguous()


@_torch_forward.register_fake
def _(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("d9d::grouped_gemm_torch_backward", mutates_args=())
def _torch_backward(
    grad: Tensor, x: Tensor, w: Tensor, group_sizes: Tensor
) -> tuple[Tensor, Tensor]:
    offsets, k, n = _offsets(group_sizes), w.shape[1], w.shape[2]
    if k == 0 or n == 0:  # both products are empty or sums of nothing
        return x.new_zeros(x.shape), w.new_zeros(w.shape)
    grad, x, w = _pad(grad, (1,)), _pad(x, (1,)), _pad(w, (1, 2))
    dx = torch._grouped_mm(grad, w.transpose(1, 2), offs=offsets)[:, :k]
    dw = torch._grouped_mm(x.t(), grad, offs=offsets)[:, :k, :n]
    return dx.contiguous(), dw.contiguous()


@_torch_backward.register_fake
def _(grad: Tensor, x: Tensor, w: Tensor, group_sizes: Tensor) -> tuple[Tensor, Tensor]:
    return _contiguous_like(x), _contiguous_like(w)


@torch.library.custom_op("d9d::grouped_gemm_triton", mutates_args=())
def _triton_forward(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    from ._triton import grouped_gemm as kernels

    return kernels.gemm(x, w, group_sizes)


@_triton_forward.register_fake
def _(x: Tensor, w: Tensor, group_sizes: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("d9d::grouped_gemm_triton_backward", mutates_args=())
def _triton_backward(
    grad: Tensor, x: Tensor, w: Tensor, group_sizes: Tensor
) -> tuple[Tensor, Tensor]:
    from ._triton import grouped_gemm as kernels

    dx = kernels.gemm(grad, w.transpose(1, 2), group_sizes)
    return dx, kernels.weight_grad(x, grad, group_sizes)


@_triton_backward.register_fake
def _(grad: Tensor, x: Tensor, w: Tensor, group_sizes: Tensor) -> tuple[Tensor, Tensor]:
    return _contiguous_like(x), _contiguous_like(w)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _autograd(backward):
    def autograd_backward(ctx, grad: Tensor):
        x, w, group_sizes = ctx.saved_tensors
        dx, dw = backward(grad.contiguous(), x, w, group_sizes)
        return dx, dw, None

    return autograd_backward


_torch_forward.register_autograd(_autograd(_torch_backward), setup_context=_setup_context)
_triton_forward.register_autograd(_autograd(_triton_backward), setup_context=_setup_context)


def _check(x: Tensor, w: Tensor, group_sizes: Tensor) -> None:
    check_floating("grouped_gemm", x=x, w=w)
    check_same("grouped_gemm", "dtype", x=x, w=w)
    check_same("grouped_gemm", "device", x=x, w=w, group_sizes=group_sizes)
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        raise KernelInputError(
            f"grouped_gemm: x must be [T, K] and w [E, K, N], got {x.shape=}, {w.shape=}"
        )
    if group_sizes.shape != (w.shape[0],) or group_sizes.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(
            f"grouped_gemm: group_sizes must be an int32 or int64 tensor of shape "
            f"[E]=({w.shape[0]},), got {group_sizes.shape=}, {group_sizes.dtype=}"
        )


def grouped_gemm(
    x: Tensor, w: Tensor, group_sizes: Tensor, *, backend: str | None = None
) -> Tensor:
    """One matmul per expert: rows ``x[start_e:end_e] @ w[e]``, rows grouped by expert in order.

    Row ``r`` belongs to expert ``e`` when ``sum(group_sizes[:e]) <= r < sum(group_sizes[:e+1])``.
    ``group_sizes`` stays on the device (no host sync); it must sum to ``T``, which is not
    checked (a check would sync): rows past the sum are undefined. Empty experts and
    ``T = 0`` are fine. Differentiable in ``x`` and ``w``.

    Args:
        x: ``[T, K]`` float tensor, its rows grouped by expert (``moe_permute``'s output).
        w: ``[E, K, N]`` tensor of ``x``'s dtype and device, one ``[K, N]`` matrix per expert.
        group_sizes: ``[E]`` integer tensor on ``x``'s device, rows per expert.
        backend: ``"torch"`` (``torch._grouped_mm``), ``"triton"``, ``"reference"``, ``"auto"``
            or None (see ``d9d.kernels.use``).

    Returns:
        ``[T, N]`` tensor of ``x``'s dtype.

    Raises:
        KernelInputError: wrong shapes, dtypes or devices.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d.kernels as K
        >>> x, w = torch.ones(3, 2), torch.stack([torch.eye(2), 2 * torch.eye(2)])
        >>> K.grouped_gemm(x, w, torch.tensor([1, 2]))
        tensor([[1., 1.],
                [2., 2.],
                [2., 2.]])
    """
    _check(x, w, group_sizes)
    return resolve("grouped_gemm", x, backend)(x, w, group_sizes)


def _torch_unavailable(device_type: str | None) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    # meta: the op's fake kernel, so a dry run on meta (d9d plan) runs what CPU runs.
    if device_type in (None, "cpu", "cuda", "meta"):
        return None
    return f"no _grouped_mm on {device_type}"


define_op("grouped_gemm", reference)
register_backend(
    "grouped_gemm",
    "triton",
    _triton_forward,
    dtypes=TRITON_DTYPES,
    unavailable=triton_unavailable,
    auto=triton_auto,
)
register_backend(
    "grouped_gemm",
    "torch",
    _torch_forward,
    dtypes={torch.float32, torch.bfloat16, torch.float16},
    unavailable=_torch_unavailable,
)
