"""``fp8_gemm`` and ``fp8_grouped_gemm``: matmuls of fp8 data with their scales; a reference
that dequantizes to float32, ``torch._scaled_mm`` (tensorwise, rowwise) and Triton (all
recipes, dense and grouped by expert)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import KernelInputError
from . import _grouped_gemm
from ._fp8_recipes import (
    FP8_DTYPES,
    RECIPES,
    dequantize,
    fp8_triton_unavailable,
    group_shape,
    scale_shape,
)
from ._registry import define_op, register_backend, resolve
from ._triton_env import triton_auto

__all__ = ["fp8_gemm", "fp8_grouped_gemm"]

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The scale groups of the GEMM's operands: a's are 1x128 tiles along K, b's 128x128 blocks.
_A_BLOCK, _B_BLOCK = (1, 128), (128, 128)


def operand_groups(recipe: str, rows: int, k: int, cols: int) -> tuple[tuple, tuple]:
    """The element groups of ``a [rows, k]``'s and ``b [k, cols]``'s scales."""
    return group_shape(rows, k, recipe, -1, _A_BLOCK), group_shape(k, cols, recipe, -2, _B_BLOCK)


def reference(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, recipe: str, out_dtype: torch.dtype
) -> Tensor:
    """``(a * a_scale) @ (b * b_scale)``, each dequantized to float32 first."""
    a_group, b_group = operand_groups(recipe, a.shape[0], a.shape[1], b.shape[1])
    return (dequantize(a, a_scale, a_group) @ dequantize(b, b_scale, b_group)).to(out_dtype)


def grouped_reference(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    group_sizes: Tensor,
    recipe: str,
    out_dtype: torch.dtype,
) -> Tensor:
    """``grouped_gemm``'s reference on the operands dequantized to float32."""
    a_group, b_group = operand_groups(recipe, a.shape[0], a.shape[1], b.shape[2])
    a_wide, b_wide = dequantize(a, a_scale, a_group), dequantize(b, b_scale, b_group)
    return _grouped_gemm.reference(a_wide, b_wide, group_sizes).to(out_dtype)


@torch.library.custom_op("d9d::fp8_grouped_gemm_triton", mutates_args=())
def _triton_grouped(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    group_sizes: Tensor,
    recipe: str,
    out_dtype: torch.dtype,
) -> Tensor:
    from ._triton import fp8_gemm as kernels

    if recipe != "blockwise":  # one scale per row of a and per column of b: broadcast views
        a_scale = a_scale.expand(a.shape[0], 1)
        b_scale = b_scale.expand(b.shape[0], 1, b.shape[2])
    return kernels.gemm(a, a_scale, b, b_scale, group_sizes, recipe, out_dtype)


@_triton_grouped.register_fake
def _(a, a_scale, b, b_scale, group_sizes, recipe, out_dtype):
    return a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype)


def _triton(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, recipe: str, out_dtype: torch.dtype
) -> Tensor:
    rows = torch.full((1,), a.shape[0], dtype=torch.int32, device=a.device)
    return _triton_grouped(a, a_scale, b[None], b_scale[None], rows, recipe, out_dtype)


@torch.library.custom_op("d9d::fp8_gemm_scaled_mm", mutates_args=())
def _scaled_mm(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, out_dtype: torch.dtype
) -> Tensor:
    # _scaled_mm wants a row-major and b column-major; a tensorwise scale may be [1, 1].
    b = b if b.stride(0) == 1 and b.stride(1) == b.shape[0] else b.t().contiguous().t()
    a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    return torch._scaled_mm(a.contiguous(), b, a_scale, b_scale, out_dtype=out_dtype)


@_scaled_mm.register_fake
def _(a, a_scale, b, b_scale, out_dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


def _torch(
    a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, recipe: str, out_dtype: torch.dtype
) -> Tensor:
    """``torch._scaled_mm``'s own limits, refused up front on every device so that code
    tested on CPU does not fail on a GPU."""
    for name, size in (("a_data.shape[1] (K)", a.shape[1]), ("b_data.shape[1] (N)", b.shape[1])):
        if size % 16:
            raise KernelInputError(
                f"fp8_gemm: the torch backend (torch._scaled_mm) needs {name} to be a multiple "
                f"of 16, got {size}; pad it, or use backend='triton' or 'reference'"
            )
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise KernelInputError(
            "fp8_gemm: torch._scaled_mm does not multiply two float8_e5m2 operands: make "
            "a_data or b_data float8_e4m3fn, or use backend='triton'"
        )
    # CUDA's rowwise kernel (aten/src/ATen/native/cuda/RowwiseScaledMM.cu) takes an e5m2 a,
    # not an e5m2 b, and writes bfloat16 only.
    if recipe == "rowwise" and a.device.type == "cuda" and out_dtype != torch.bfloat16:
        raise KernelInputError(
            f"fp8_gemm: rowwise torch._scaled_mm on CUDA writes bfloat16 only, got "
            f"{out_dtype=}; use out_dtype=torch.bfloat16 or backend='triton'"
        )
    if recipe == "rowwise" and a.device.type == "cuda" and b.dtype != torch.float8_e4m3fn:
        raise KernelInputError(
            f"fp8_gemm: rowwise torch._scaled_mm on CUDA takes a float8_e4m3fn b_data, got "
            f"b_data.dtype={b.dtype}; swap the operands (out.T = b.T @ a.T) or use "
            f"backend='triton'"
        )
    return _scaled_mm(a, a_scale, b, b_scale, out_dtype)


def _scaled_mm_recipes(device_type: str) -> tuple[str, ...]:
    """Rowwise on CUDA and meta; on CPU only where this torch's ``_scaled_mm`` has it (2.11's
    CPU kernel has tensorwise scales only, and fails an internal assert on rowwise ones)."""
    if device_type == "cpu" and not _cpu_scaled_mm_is_rowwise():
        return ("tensorwise",)
    return ("tensorwise", "rowwise")


@functools.cache
def _cpu_scaled_mm_is_rowwise() -> bool:
    with _disable_current_modes():  # a real CPU call, also inside a fake or dispatch mode
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        ones = torch.ones(16, 1)
        try:
            torch._scaled_mm(a, a.t(), ones, ones.t(), out_dtype=torch.float32)
        except RuntimeError:
            return False
    return True


def _scaled_mm_unavailable(device_type: str | None) -> str | None:
    if device_type == "cuda" or (device_type is None and torch.cuda.is_available()):
        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            return f"torch._scaled_mm needs compute capability 8.9+, this GPU has {capability}"
        return None
    if device_type in (None, "cpu", "meta"):  # meta: its fake kernel, for dry runs
        return None
    return f"no torch._scaled_mm on {device_type}"


def _check_scale(op: str, name: str, scale: Tensor, expected: tuple[int, ...], recipe: str):
    if not isinstance(scale, Tensor) or scale.dtype != torch.float32:
        raise KernelInputError(
            f"{op}: {name} must be a float32 tensor, got {getattr(scale, 'dtype', type(scale))}"
        )
    if tuple(scale.shape) != tuple(expected):
        raise KernelInputError(
            f"{op}: {name}.shape={tuple(scale.shape)}, expected {tuple(expected)} for {recipe=} "
            f"(fp8_quantize gives it)"
        )


def _check(op: str, a: Tensor, b: Tensor, recipe: str, out_dtype: torch.dtype, **more) -> None:
    for name, data in (("a_data", a), ("b_data", b)):
        if not isinstance(data, Tensor) or data.dtype not in FP8_DTYPES:
            raise KernelInputError(
                f"{op}: {name} must be float8_e4m3fn or float8_e5m2 (fp8_quantize's data), got "
                f"{getattr(data, 'dtype', type(data))}"
            )
    if recipe not in RECIPES:
        raise KernelInputError(f"{op}: unknown {recipe=}; recipes are {list(RECIPES)}")
    if out_dtype not in OUT_DTYPES:
        raise KernelInputError(f"{op}: {out_dtype=} is not one of {list(OUT_DTYPES)}")
    devices = {name: t.device for name, t in (("a_data", a), ("b_data", b), *more.items())}
    if len(set(devices.values())) > 1:
        raise KernelInputError(f"{op}: tensors on different devices: {devices}")


def fp8_gemm(
    a_data: Tensor,
    a_scale: Tensor,
    b_data: Tensor,
    b_scale: Tensor,
    recipe: str,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str | None = None,
) -> Tensor:
    """``(a_data * a_scale) @ (b_data * b_scale)`` with float32 accumulation, in ``out_dtype``.

    The operands are ``fp8_quantize``'s outputs: ``a`` quantized along K (its defaults) and
    ``b`` along K too (``dim=-2`` rowwise, ``block=(128, 128)`` blockwise). A linear layer's
    weight ``w [N, K]`` quantized with the defaults is ``b = w_data.t()``, ``b_scale =
    w_scale.t()`` (views; rowwise and tensorwise). Not differentiable.

    Args:
        a_data: ``[M, K]`` fp8 tensor.
        a_scale: float32; ``[1, 1]`` (tensorwise), ``[M, 1]`` (rowwise), ``[M, ceil(K/128)]``
            (blockwise, 1x128 tiles).
        b_data: ``[K, N]`` fp8 tensor, any strides (column-major suits ``torch._scaled_mm``).
        b_scale: float32; ``[1, 1]``, ``[1, N]``, ``[ceil(K/128), ceil(N/128)]`` (128x128).
        recipe: ``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``.
        out_dtype: float32, bfloat16 (default) or float16.
        backend: ``"torch"`` (``torch._scaled_mm``: tensorwise and rowwise), ``"triton"``,
            ``"reference"``, ``"auto"`` or None (see ``d9d.kernels.use``).

    Returns:
        ``[M, N]`` tensor of ``out_dtype``.

    Raises:
        KernelInputError: data not fp8, scales not float32 or of the wrong shape, an unknown
            recipe, mismatched shapes or devices; for ``torch``, K or N not multiples of 16,
            two e5m2 operands, or rowwise on CUDA with an e5m2 ``b_data`` or an
            ``out_dtype`` other than bfloat16.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here (``torch`` with blockwise).

    Example:
        >>> import d9d.kernels as K
        >>> a, a_scale = K.fp8_quantize(torch.ones(2, 16), "rowwise")
        >>> b, b_scale = K.fp8_quantize(torch.ones(16, 16), "rowwise", dim=-2)
        >>> K.fp8_gemm(a, a_scale, b, b_scale, "rowwise", torch.float32)[0, :2]
        tensor([16., 16.])
    """
    op = "fp8_gemm"
    _check(op, a_data, b_data, recipe, out_dtype, a_scale=a_scale, b_scale=b_scale)
    if a_data.dim() != 2 or b_data.dim() != 2 or a_data.shape[1] != b_data.shape[0]:
        raise KernelInputError(
            f"{op}: a_data must be [M, K] and b_data [K, N], got {a_data.shape=}, {b_data.shape=}"
        )
    _check_scale(op, "a_scale", a_scale, scale_shape(a_data.shape, recipe, -1, _A_BLOCK), recipe)
    _check_scale(op, "b_scale", b_scale, scale_shape(b_data.shape, recipe, -2, _B_BLOCK), recipe)
    impl = resolve(op, a_data, backend, recipe)
    return impl(a_data, a_scale, b_data, b_scale, recipe, out_dtype)


def fp8_grouped_gemm(
    a_data: Tensor,
    a_scale: Tensor,
    b_data: Tensor,
    b_scale: Tensor,
    group_sizes: Tensor,
    recipe: str,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    backend: str | None = None,
) -> Tensor:
    """``grouped_gemm`` of fp8 operands: rows of expert ``e`` times ``b[e]``, dequantized.

    Row ``r`` belongs to expert ``e`` as in ``grouped_gemm`` (``group_sizes`` stays on the
    device and must sum to ``T``, unchecked). ``b_data [E, K, N]`` is quantized per expert
    along K (``fp8_quantize`` of the 3-d weights with ``dim=-2`` or ``block=(128, 128)``).
    Not differentiable.

    Args:
        a_data: ``[T, K]`` fp8 tensor, rows grouped by expert.
        a_scale: float32; ``[1, 1]``, ``[T, 1]`` or ``[T, ceil(K/128)]`` as in ``fp8_gemm``.
        b_data: ``[E, K, N]`` fp8 tensor.
        b_scale: float32; ``[E, 1, 1]``, ``[E, 1, N]`` or ``[E, ceil(K/128), ceil(N/128)]``.
        group_sizes: ``[E]`` int32 or int64 tensor, rows per expert.
        recipe: ``"tensorwise"``, ``"rowwise"`` or ``"blockwise"``.
        out_dtype: float32, bfloat16 (default) or float16.
        backend: ``"triton"``, ``"reference"``, ``"auto"`` or None.

    Returns:
        ``[T, N]`` tensor of ``out_dtype``.

    Raises:
        KernelInputError: as ``fp8_gemm``, and a ``group_sizes`` that is not ``[E]`` integers.
        UnknownKernelError: unknown backend name.
        KernelUnavailableError: the forced backend cannot run here.

    Example:
        >>> import d9d.kernels as K
        >>> a, a_scale = K.fp8_quantize(torch.ones(3, 16), "tensorwise")
        >>> w, w_scale = K.fp8_quantize(torch.ones(2, 16, 4), "tensorwise")
        >>> K.fp8_grouped_gemm(a, a_scale, w, w_scale, torch.tensor([1, 2]), "tensorwise",
        ...                    torch.float32)[:, 0]
        tensor([16., 16., 16.])
    """
    op = "fp8_grouped_gemm"
    _check(op, a_data, b_data, recipe, out_dtype, group_sizes=group_sizes)
    if a_data.dim() != 2 or b_data.dim() != 3 or a_data.shape[1] != b_data.shape[1]:
        raise KernelInputError(
            f"{op}: a_data must be [T, K] and b_data [E, K, N], got {a_data.shape=}, "
            f"{b_data.shape=}"
        )
    if group_sizes.shape != (b_data.shape[0],) or group_sizes.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise KernelInputError(
            f"{op}: group_sizes must be an int32 or int64 tensor of shape [E]=({b_data.shape[0]},)"
            f", got {group_sizes.shape=}, {group_sizes.dtype=}"
        )
    _check_scale(op, "a_scale", a_scale, scale_shape(a_data.shape, recipe, -1, _A_BLOCK), recipe)
    _check_scale(op, "b_scale", b_scale, scale_shape(b_data.shape, recipe, -2, _B_BLOCK), recipe)
    impl = resolve(op, a_data, backend, recipe)
    return impl(a_data, a_scale, b_data, b_scale, group_sizes, recipe, out_dtype)


define_op("fp8_gemm", reference, dtypes=FP8_DTYPES)
register_backend(
    "fp8_gemm",
    "triton",
    _triton,
    dtypes=FP8_DTYPES,
    unavailable=fp8_triton_unavailable,
    auto=triton_auto,
)
register_backend(
    "fp8_gemm",
    "torch",
    _torch,
    dtypes=FP8_DTYPES,
    unavailable=_scaled_mm_unavailable,
    variants=_scaled_mm_recipes,
)
define_op("fp8_grouped_gemm", grouped_reference, dtypes=FP8_DTYPES)
register_backend(
    "fp8_grouped_gemm",
    "triton",
    _triton_grouped,
    dtypes=FP8_DTYPES,
    unavailable=fp8_triton_unavailable,
    auto=triton_auto,
)
