"""How ``tensor_parallel`` lays activations out on its mesh axis, and moves them between
layouts: the collectives at module boundaries."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ...core._context import sequence_length
from ...core._shard_rows import shard_rows
from ...errors import IndivisibleError

__all__ = ["HEAD_AXES", "PARTIAL_GRAD_AXES", "SEQUENCE_DIM", "ActivationLayout"]

SEQUENCE_DIM = 1

# Logical axes of params replicated on the axis that only the rank's heads or mlp shard read
# (per-head norms; latent attention's down-projections and their norms; scalars of an
# activation on the mlp's hidden width): their grads, and the input grads through them, are
# partial sums over the axis, in both modes.
PARTIAL_GRAD_AXES = ("head_dim", "latent", "mlp_scale")
HEAD_AXES = ("heads", "kv_heads")  # attention's head counts, split over tp


@dataclass(frozen=True)
class ActivationLayout:
    """How ``tensor_parallel`` lays activations out on its mesh axis.

    Attributes:
        mesh: The one-dimensional mesh of the tensor-parallel axis.
        axis: Its name.
        index: Its position among the full mesh's axes.
        rank: This rank's coordinate on it.
        sequence_parallel: Norms and the residual stream hold ``S / tp`` positions.
        loss_parallel: The head's logits stay vocab-sharded for the loss.
    """

    mesh: DeviceMesh
    axis: str
    index: int
    rank: int
    sequence_parallel: bool
    loss_parallel: bool

    @property
    def size(self) -> int:
        """Ranks on the axis."""
        return self.mesh.size()

    def slice_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's positions of ``x`` (dim 1); the backward all-gathers."""
        _check_sequence(x, SEQUENCE_DIM, self.size, self.axis)
        return self._local(x, [Replicate()], [Shard(SEQUENCE_DIM)])

    def enter_region(self, x: torch.Tensor, sequence_sharded: bool) -> torch.Tensor:
        """``x`` whole for column-parallel linears; its grad is summed over the axis."""
        source = [Shard(_positions_dim(x))] if sequence_sharded else [Replicate()]
        dtensor = DTensor.from_local(x, self.mesh, source, run_check=False)
        if sequence_sharded:
            dtensor = dtensor.redistribute(self.mesh, [Replicate()])
        return dtensor.to_local(grad_placements=[Partial()])

    def reduce_partial(self, y: torch.Tensor, sequence_sharded: bool) -> torch.Tensor:
        """The sum over ranks of partial ``y``: sequence-sharded, or whole."""
        if sequence_sharded:
            _check_sequence(y, _positions_dim(y), self.size, self.axis)
            return self._local(y, [Partial()], [Shard(_positions_dim(y))])
        return self._local(y, [Partial()], [Replicate()])

    def gather_last_dim(self, y: torch.Tensor, full: int) -> torch.Tensor:
        """The whole of ``y``, sharded over its last dim (``full`` entries in all)."""
        return self.vocab_dtensor(y, full).full_tensor()

    def vocab_dtensor(self, y: torch.Tensor, full: int) -> DTensor:
        """``y``, this rank's shard of a last dim of ``full`` entries, as a DTensor."""
        shape = (*y.shape[:-1], full)
        stride = torch.empty(shape, device="meta").stride()
        placement = [Shard(y.ndim - 1)]
        return DTensor.from_local(
            y, self.mesh, placement, run_check=False, shape=torch.Size(shape), stride=stride
        )

    def rows(self, total: int) -> tuple[int, int]:
        """``(first, count)`` of this rank's rows of a dim of ``total`` (``torch.chunk``)."""
        return shard_rows(total, self.size, self.rank)

    def _local(self, x: torch.Tensor, source: list, target: list) -> torch.Tensor:
        dtensor = DTensor.from_local(x, self.mesh, source, run_check=False)
        return dtensor.redistribute(self.mesh, target).to_local()


def _positions_dim(x: torch.Tensor) -> int:
    """The dim of ``x`` that holds the rank's positions: the sequence of ``[batch, seq, ...]``,
    or the tokens of ``[tokens, features]``, as a position-wise module flattens them before its
    shared experts (Qwen2-MoE's): gathered and scattered back in the same rank order, which
    per-position work does not see."""
    return 0 if x.ndim == 2 else SEQUENCE_DIM


def _check_sequence(x: torch.Tensor, dim: int, size: int, axis: str) -> None:
    if x.ndim <= dim or x.shape[dim] % size:
        # Under context_parallel the rank holds a part of each sequence, which is what splits.
        local = x.shape[dim] if x.ndim > dim else 1
        parts = sequence_length(local) // local if dim == SEQUENCE_DIM else 1
        held = (
            f" (this rank's {local} positions of sequences of {local * parts}, which "
            f"context parallelism splits {parts} ways)"
            if parts > 1
            else ""
        )
        raise IndivisibleError(
            f"sequence parallelism splits dim {dim} of activations {tuple(x.shape)}{held} "
            f"over {size} {axis!r} ranks; use a sequence length divisible by {parts * size}"
            + (
                " that context parallelism also splits (zigzag needs 2 chunks a rank)"
                if parts > 1
                else ""
            )
            + ", or tensor_parallel(..., sequence_parallel=False)"
        )
