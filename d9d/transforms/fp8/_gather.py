"""The fp8 all-gather of a weight: ``shard_params`` gathers its tensorwise e4m3 data, and
the fp8 linear multiplies that data with its scale; no high-precision copy of the weight
crosses the wire, and the weight is not quantized a second time.

[Note: the scale of a sharded weight] Tensorwise fp8 scales a weight by its amax over the
whole matrix as a block computes with it (``fp8_quantize``: ``amax / 448``). Each rank holds
a shard, so the shards' amaxes are all-reduced (``max``, over the gathering axis: one float32
per weight; the step takes all of them in one all-reduce as it starts, since it does not
change the stored shards: ``codec_statistics`` in ``d9d/core/_codec_statistics.py``); the gather then
quantizes its shard with that scale, all-gathers the fp8 data (1 byte per element) and
rebuilds the weight as :class:`Fp8Weight` (data and the scale every rank holds already).
Each element is quantized from the value the block would compute with (the stored shard
cast to ``shard_params``' ``param_dtype`` first), by the same division as the reference
``fp8_quantize``, so the data and scale equal those the fp8 linear takes of the gathered
high-precision weight: the step is bitwise the fp8 step without the fp8 gather. Under
``tensor_parallel`` the amax is reduced over the gathering axis only: the scale of the
rank's tensor-parallel shard, as without the fp8 gather. torchao's float8 all-gather
(``fsdp_pre_all_gather``) is the model; it quantizes the float32 master weight instead.

[Note: the fp8 all-gather under d9d.jit] Dynamo traces no tensor subclass out of an
autograd function: it traces the backward with grads of the outputs' type, and the core's
gathers are autograd functions (their backward reduce-scatters the grads). Under
``torch.compile`` the codec therefore decodes into plain tensors, ``(weight, data,
scale)``: ``weight`` a zero of the compute dtype expanded to the weight's shape (no
memory), the one autograd differentiates, its grad the weight grad that comes back to the
gather; ``data`` and ``scale`` as in :class:`Fp8Weight`, not differentiated. The core's
gathers return that tuple as the weight (``parts``: ``Cast``'s doc in
``d9d/core/_param_plan.py``), the fp8 linear takes its data and scale as eager takes the
subclass's, and the compiled step is the eager one bitwise under aot_eager.

[Note: the routed experts' stacked weights] The fp8 grouped GEMM scales an experts weight
``[E, K, N]`` one scale per expert (``fp8_quantize`` of a stack: the amax of ``w[e]``), so
its codec (``stacked=True``) takes one amax per expert: ``statistic_dim = 0``, which the core
reduces index by index (``Cast``'s doc in ``d9d/core/_param_plan.py``). Under
``shard_params`` alone the experts are ``Shard(0)`` over the gathering axis: each rank holds
whole experts, lays their amaxes at its experts' offset (``-inf`` for the others) and the
all-reduce gives every rank all ``E``; under ``expert_parallel`` x ``shard_params`` they are
``Shard(0)`` over ``ep`` (not gathered) and ``Shard(1)`` over ``fsdp``: the ``E / ep``
amaxes of the rank's experts are all-reduced over ``fsdp`` only. Either way each expert's
scale is the one the fp8 grouped GEMM takes of the whole weight on one device.

Tensorwise only: rowwise scales the weight along ``K`` in the forward and along ``N`` in the
input grad (two quantizations of one weight, so one gathered copy serves only one of them),
and blockwise's 128x128 blocks straddle the shards' rows; both are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ...kernels._fp8_recipes import AMAX_EPS, fp8_max
from ._linear import E4M3
from ._weight import Fp8Weight

__all__ = ["Fp8Gather"]


@dataclass(frozen=True)
class Fp8Gather:
    """The gather codec of a weight the fp8 linear computes with in tensorwise fp8: its
    shard cast to ``compute_dtype``, quantized to e4m3 with the scale of the whole weight's
    amax (the all-reduced ``statistic``), gathered, and decoded as :class:`Fp8Weight`.

    Attributes:
        compute_dtype: The dtype the weight is computed with and its grad comes back in
            (``shard_params``' ``param_dtype``, else the param's own).
        stacked: The weight is a stack of routed experts ``[E, K, N]``, scaled one per
            expert (the module's note on experts); else a linear's, one scale.
    """

    compute_dtype: torch.dtype
    stacked: bool = False
    statistic_op: ClassVar[str] = "max"

    @property
    def statistic_dim(self) -> int | None:
        """0 for a stack of experts (an amax per expert), else None (one amax)."""
        return 0 if self.stacked else None

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype all-gathered: the e4m3 bits as uint8 (gloo gathers no fp8 dtype:
        "Invalid scalar type"; NCCL moves fp8 as uint8 too)."""
        return torch.uint8

    def _wide(self, shard: Tensor) -> Tensor:
        return shard.detach().to(self.compute_dtype).float()

    def statistic(self, shard: Tensor) -> Tensor:
        """``[1]``, the shard's amax as the block would compute with it; stacked, ``[E']``,
        the amax of each of the shard's ``E'`` experts."""
        values = shard.shape[0] if self.stacked else 1
        if shard.numel() == 0:  # an uneven shard with no rows
            return shard.new_zeros(values, dtype=torch.float32)
        wide = self._wide(shard).abs()
        return wide.amax(dim=(1, 2)) if self.stacked else wide.amax().reshape(1)

    def _scale(self, amax: Tensor | None) -> Tensor:
        """``[1, 1]``, or ``[E, 1, 1]`` stacked: ``fp8_quantize``'s scale of each matrix."""
        if amax is None:
            raise ValueError("the fp8 gather codec needs the all-reduced amax of the weight")
        amax = amax.reshape(-1, 1, 1) if self.stacked else amax.reshape(1, 1)
        amax = amax.clamp(min=AMAX_EPS)
        return amax / torch.full_like(amax, fp8_max(E4M3))  # fp8_quantize's own division

    def encode(self, shard: Tensor, statistic: Tensor | None = None) -> Tensor:
        """The shard's e4m3 data under the whole weight's scale (stacked: each expert's),
        its bits as uint8."""
        limit = fp8_max(E4M3)
        data = (self._wide(shard) / self._scale(statistic)).clamp(-limit, limit).to(E4M3)
        return data.view(self.wire_dtype)

    @property
    def parts(self) -> int:
        """How many tensors :meth:`decode` returns: the :class:`Fp8Weight`, or under
        ``torch.compile`` its three plain parts."""
        return 3 if torch.compiler.is_compiling() else 1

    def decode(
        self, gathered: Tensor, statistic: Tensor | None = None
    ) -> Fp8Weight | tuple[Tensor, Tensor, Tensor]:
        """The gathered data with its scale, as the weight to compute with: an
        :class:`Fp8Weight`, or under ``torch.compile`` ``(weight, data, scale)`` (see the
        module's note on jit)."""
        data, scale = gathered.view(E4M3), self._scale(statistic)
        if not torch.compiler.is_compiling():
            return Fp8Weight(data, scale, self.compute_dtype)
        # No memory: a zero expanded to the weight's shape, whose grad is the weight's.
        weight = scale.new_zeros((), dtype=self.compute_dtype).expand(data.shape)
        return weight, data, scale
