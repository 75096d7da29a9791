"""A weight gathered in fp8: tensorwise e4m3 data and its scale, which autograd sees as a
tensor of the weight's compute dtype (``_gather``'s codec builds it in eager, ``_linear``
reads it; under ``d9d.jit`` the codec hands out the same data and scale as plain tensors:
``_gather``'s note)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map_only

__all__ = ["Fp8Weight"]

# Ops that only lay the data out: the same elements under the one tensorwise scale.
_LAYOUT_OPS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.clone.default,
}


class Fp8Weight(torch.Tensor):
    """A gathered weight as tensorwise e4m3 data and its float32 ``[1, 1]`` scale (a stack
    of routed experts ``[E, K, N]``: ``[E, 1, 1]``, one per expert), seen by autograd as a
    tensor of ``dtype`` (its grad comes back in ``dtype``).

    Only the fp8 linear and the fp8 grouped GEMM compute with it (``fp8_data``,
    ``fp8_scale``); layout ops (detach, transpose, views) apply to the data, any other op
    raises naming it.
    """

    fp8_data: Tensor
    fp8_scale: Tensor

    @staticmethod
    def __new__(cls, data: Tensor, scale: Tensor, dtype: torch.dtype) -> Fp8Weight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=dtype,
            device=data.device,
        )

    def __init__(self, data: Tensor, scale: Tensor, dtype: torch.dtype) -> None:
        del dtype
        self.fp8_data = data
        self.fp8_scale = scale

    def __repr__(self) -> str:
        return (
            f"Fp8Weight(shape={list(self.shape)}, dtype={self.dtype}, "
            f"scale={self.fp8_scale.flatten().tolist()})"
        )

    def untyped_storage(self) -> torch.UntypedStorage:
        """The data's storage: ``shard_params``' regather keys saved tensors on it."""
        return self.fp8_data.untyped_storage()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func not in _LAYOUT_OPS:
            raise RuntimeError(
                f"a weight all-gathered in fp8 (fp8(gather_in_fp8=True)) met {func}: only the "
                "fp8 linear computes with it; exclude the module that uses it from fp8 "
                "(fp8(exclude=...)) or drop gather_in_fp8"
            )
        (weight,) = [a for a in args if isinstance(a, Fp8Weight)]
        data = func(*tree_map_only(Fp8Weight, lambda w: w.fp8_data, args), **(kwargs or {}))
        return Fp8Weight(data, weight.fp8_scale, weight.dtype)
