"""Tensor-parallel activations: the collectives at module boundaries, as Megatron places them.

Blocks compute on local tensors: the param shards their plan gives them. Under
``tensor_parallel`` the hooks that ``functionalize`` installs move activations between layouts
where a module boundary needs it. Roles come from the plan: an ``nn.Linear`` whose weight is
``Shard(0)`` on the tensor-parallel axis is column-parallel, ``Shard(1)`` row-parallel, an
``nn.Embedding`` with ``Shard(0)`` vocab-parallel. A *region* is a child of a block (``attn``,
``mlp``) or a linear outside any block (the output head).

- A region holding column-parallel linears gets its input whole: an all-gather of the sequence
  shards (sequence parallel; its backward is a reduce-scatter) or, without sequence
  parallelism, the identity whose backward all-reduces.
- A row-parallel linear's output is a partial sum: reduce-scattered over the sequence
  (sequence parallel) or all-reduced. Its bias is added after that reduction.
- A column-parallel linear outside blocks (the head) returns its vocab shard as a DTensor
  ``Shard(-1)`` (loss parallel: ``d9d.losses.cross_entropy`` never gathers it) or all-gathered.
- A vocab-parallel embedding looks up the ids in its rows, zeroes the others and all-reduces.
- With sequence parallelism the first block slices the residual stream over the sequence
  (dim 1): model code between the embedding and the blocks (masks and positions) sees the
  whole sequence, and every block after it sees ``S / tp`` positions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .errors import IndivisibleError, PlanError

if TYPE_CHECKING:
    from ._gather import _Frame

__all__ = ["ActivationLayout", "replace_input"]

SEQUENCE_DIM = 1


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
        _check_sequence(x, self.size, self.axis)
        return self._local(x, [Replicate()], [Shard(SEQUENCE_DIM)])

    def enter_region(self, x: torch.Tensor, sequence_sharded: bool) -> torch.Tensor:
        """``x`` whole for column-parallel linears; its grad is summed over the axis."""
        source = [Shard(SEQUENCE_DIM)] if sequence_sharded else [Replicate()]
        dtensor = DTensor.from_local(x, self.mesh, source, run_check=False)
        if sequence_sharded:
            dtensor = dtensor.redistribute(self.mesh, [Replicate()])
        return dtensor.to_local(grad_placements=[Partial()])

    def reduce_partial(self, y: torch.Tensor, sequence_sharded: bool) -> torch.Tensor:
        """The sum over ranks of partial ``y``: sequence-sharded, or whole."""
        if sequence_sharded:
            _check_sequence(y, self.size, self.axis)
            return self._local(y, [Partial()], [Shard(SEQUENCE_DIM)])
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
        chunk = -(-total // self.size)
        first = min(self.rank * chunk, total)
        return first, min(chunk, total - first)

    def _local(self, x: torch.Tensor, source: list, target: list) -> torch.Tensor:
        dtensor = DTensor.from_local(x, self.mesh, source, run_check=False)
        return dtensor.redistribute(self.mesh, target).to_local()


def _check_sequence(x: torch.Tensor, size: int, axis: str) -> None:
    if x.ndim <= SEQUENCE_DIM or x.shape[SEQUENCE_DIM] % size:
        raise IndivisibleError(
            f"sequence parallelism splits dim {SEQUENCE_DIM} of activations {tuple(x.shape)} "
            f"over {size} {axis!r} ranks; use a sequence length divisible by {size}, or "
            "tensor_parallel(..., sequence_parallel=False)"
        )


def linear_role(frame: _Frame, path: str) -> str | None:
    """``"column"``, ``"row"`` or None for the linear at module ``path`` under the frame's plan."""
    layout = frame.plan.activations
    key = frame.model.tied.get(f"{path}.weight", f"{path}.weight")
    entry = frame.plan.entries.get(key)
    if layout is None or entry is None:
        return None
    placement = entry.compute[layout.index]
    if isinstance(placement, Shard):
        return "column" if placement.dim == 0 else "row"
    return None


def replace_input(
    args: tuple[Any, ...], kwargs: dict[str, Any], path: str, fn: Callable[[Any], Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with the activation (first positional tensor, or ``hidden_states``)
    replaced by ``fn`` of it."""
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise PlanError(
        f"cannot find the activation input of module {path!r}: it must take it as the first "
        "positional tensor or as hidden_states="
    )


def enter_block(frame: _Frame, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    """Slice the residual stream over the sequence when the first block starts."""
    layout = frame.plan.activations
    if layout is None or not layout.sequence_parallel or frame.sequence_sharded:
        return None
    frame.sequence_sharded = True
    return replace_input(args, kwargs, "block", layout.slice_sequence)


def enter_module(
    frame: _Frame, path: str, module: nn.Module, args: Any, kwargs: Any
) -> tuple[Any, Any] | None:
    """Forward pre-hook work of module ``path`` (see the module docstring)."""
    layout = frame.plan.activations
    assert layout is not None
    changed = False
    region = frame.model._regions.get(path)
    if region is not None:
        roles = {linear_role(frame, linear) for linear in region}
        if "column" in roles:
            _check_region(path, region, roles, module)
            args, kwargs = replace_input(
                args, kwargs, path, lambda x: layout.enter_region(x, frame.sequence_sharded)
            )
            changed = True
        elif "row" in roles:
            raise PlanError(
                f"module {path!r} holds row-parallel linears but no column-parallel one: "
                "tensor_parallel shards a column-parallel linear's output (heads, mlp) and "
                "the row-parallel linear after it; check the logical axes of its params"
            )
    if isinstance(module, nn.Embedding) and _embedding_sharded(frame, path):
        _check_embedding(path, module)
        tokens, first, count = args[0], *layout.rows(module.num_embeddings)
        outside = (tokens < first) | (tokens >= first + count)
        # The padding row (no gradient) is global: local on the rank holding it, else none.
        frame.stash[path] = outside, module.padding_idx
        module.padding_idx = _local_row(module.padding_idx, first, count)
        args, changed = ((tokens - first).masked_fill(outside, 0), *args[1:]), True
    row = isinstance(module, nn.Linear) and linear_role(frame, path) == "row"
    if row and module.bias is not None:
        frame.stash[path] = module._parameters["bias"]
        module._parameters["bias"] = None
    return (args, kwargs) if changed else None


def exit_module(frame: _Frame, path: str, module: nn.Module, output: Any) -> Any:
    """Forward hook work of module ``path``: the new output, or None to keep it."""
    layout = frame.plan.activations
    assert layout is not None
    if isinstance(module, nn.Embedding) and _embedding_sharded(frame, path):
        outside, module.padding_idx = frame.stash.pop(path)
        return layout.reduce_partial(output.masked_fill(outside.unsqueeze(-1), 0), False)
    if not isinstance(module, nn.Linear):
        return None
    role = linear_role(frame, path)
    if role == "row":
        output = layout.reduce_partial(output, frame.sequence_sharded)
        bias = frame.stash.pop(path, None)
        if bias is not None:
            module._parameters["bias"] = bias
            output = output + bias
        return output
    if role == "column" and path in frame.model._regions:
        if layout.loss_parallel:
            return layout.vocab_dtensor(output, module.out_features)
        return layout.gather_last_dim(output, module.out_features)
    return None


def restore_modules(frame: _Frame) -> None:
    """Put back what pre-hooks swapped out of modules whose hook never ran: an embedding's
    ``padding_idx``, a row-parallel linear's bias."""
    for path, stashed in frame.stash.items():
        module = frame.model.module.get_submodule(path)
        if isinstance(module, nn.Embedding):
            module.padding_idx = stashed[1]
        else:
            module._parameters["bias"] = stashed
    frame.stash.clear()


def _embedding_sharded(frame: _Frame, path: str) -> bool:
    layout = frame.plan.activations
    key = frame.model.tied.get(f"{path}.weight", f"{path}.weight")
    placement = frame.plan.entries[key].compute[layout.index]
    if isinstance(placement, Shard) and placement.dim != 0:
        raise PlanError(
            f"embedding {key!r} is sharded over its embedding dim on {layout.axis!r}; "
            "tensor_parallel shards embeddings over the vocab: give it logical axes "
            "('vocab', 'embed')"
        )
    return isinstance(placement, Shard)


def _local_row(row: int | None, first: int, count: int) -> int | None:
    """Global ``row`` as an index into the local rows ``[first, first + count)``, or None."""
    return row - first if row is not None and first <= row < first + count else None


def _check_embedding(path: str, module: nn.Embedding) -> None:
    """Raise for options whose effect depends on rows outside the local vocab shard."""
    if module.max_norm is not None or module.scale_grad_by_freq:
        raise PlanError(
            f"embedding {path!r} has max_norm={module.max_norm} and "
            f"scale_grad_by_freq={module.scale_grad_by_freq}, which a vocab-parallel lookup "
            "cannot honour (each rank sees only its rows); build it without them, or keep it "
            "whole on the axis with logical axes that map to no mesh axis (e.g. "
            "('embed', 'embed'))"
        )


def _check_region(path: str, region: tuple[str, ...], roles: set, module: nn.Module) -> None:
    if "row" not in roles and not isinstance(module, nn.Linear):
        raise PlanError(
            f"module {path!r} holds column-parallel linears but no row-parallel one, so its "
            "output would stay sharded; shard the linear that consumes them on its input "
            f"dim (linears here: {list(region)})"
        )


def check_modules(model: Any, entries: Mapping[str, Any], layout: ActivationLayout) -> None:
    """Raise, before any collective, for params the runtime cannot lay out: see
    :func:`_check_sharded` and :func:`_check_sequence_regions`."""
    _check_sharded(model, entries, layout)
    if layout.sequence_parallel:
        _check_sequence_regions(model, entries, layout)


def _check_sequence_regions(
    model: Any, entries: Mapping[str, Any], layout: ActivationLayout
) -> None:
    """Under sequence parallelism a region with no sharded linear runs on ``S / tp``
    positions: right for a norm, wrong for attention or a head. Raise for a weight (2 dims
    or more) whole on the axis in such a region."""

    def sharded(key: str) -> bool:
        entry = entries.get(model.tied.get(key, key))
        return entry is not None and isinstance(entry.compute[layout.index], Shard)

    regions = model._regions
    for slot in model._slots:
        parts = slot.key.split(".")
        prefixes = (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1))
        region = next((p for p in prefixes if p in regions), None)
        entry = entries.get(model.tied.get(slot.key, slot.key)) if slot.is_param else None
        if (
            region is None
            or entry is None
            or len(entry.shape) < 2
            or sharded(slot.key)
            or any(sharded(f"{linear}.weight") for linear in regions[region])
        ):
            continue
        raise PlanError(
            f"module {region!r} holds {slot.key!r} whole on {layout.axis!r} and no sharded "
            "nn.Linear, so under sequence parallelism it would run on this rank's "
            f"S / {layout.size} positions only (wrong for attention, or for a head whose loss "
            "the ranks do not sum); shard its linears (logical axes heads, mlp, vocab) or use "
            "tensor_parallel(..., sequence_parallel=False)"
        )


def _check_sharded(model: Any, entries: Mapping[str, Any], layout: ActivationLayout) -> None:
    """Raise unless every param sharded over the axis belongs to a module whose shard the
    runtime knows how to use: an ``nn.Linear``'s weight (column- or row-parallel) or a
    column-parallel linear's bias, an ``nn.Embedding``'s weight over the vocab."""
    for slot in model._slots:
        key = model.tied.get(slot.key, slot.key)
        entry = entries.get(key)
        placement = entry.compute[layout.index] if slot.is_param and entry is not None else None
        if not isinstance(placement, Shard):
            continue
        owner, name = slot.owner, slot.name
        weight_key = f"{slot.key.rpartition('.')[0]}.weight"
        weight = entries.get(model.tied.get(weight_key, weight_key))
        column = weight is not None and weight.compute[layout.index] == Shard(0)
        match owner, name, placement.dim:
            case nn.Linear(), "weight", 0 | 1:
                continue
            case nn.Linear(), "bias", 0 if column:
                continue
            case nn.Embedding(), "weight", 0:
                continue
        path = slot.key.rpartition(".")[0]
        raise PlanError(
            f"param {slot.key!r} is sharded over {layout.axis!r} (dim {placement.dim}, logical "
            f"axis {entry.axes[placement.dim]!r}), but its module {path!r} is a "
            f"{type(owner).__name__}, which tensor_parallel does not know how to run on a "
            "shard: it shards nn.Linear weights (column- or row-parallel), a column-parallel "
            "linear's bias and nn.Embedding weights over the vocab. Keep this param whole on "
            f"{layout.axis!r}: give it logical axes that map to no mesh axis (e.g. "
            f"functionalize(module, axes={{{_rule(slot.key)!r}: "
            f"{('embed',) * len(entry.shape)}}})). (A transformers Conv1D is a transposed "
            "linear, and a fused q/k/v weight splits per head group, not per row range.)"
        )


def _rule(key: str) -> str:
    """An ``axes=`` pattern for the param at ``key``: its module's name and its own."""
    module, _, name = key.rpartition(".")
    return re.escape(f"{module.rpartition('.')[2]}.{name}") + "$"


def check_own_loss(frame: _Frame, kwargs: dict[str, Any]) -> None:
    """Raise when the model is asked for its own loss (``labels=``) while its head returns
    vocab-sharded logits, which a loss written for whole logits (``F.cross_entropy``) cannot
    take."""
    layout = frame.plan.activations
    if layout is None or not layout.loss_parallel or kwargs.get("labels") is None:
        return
    regions = frame.model._regions
    heads = [p for p, r in regions.items() if r == (p,) and linear_role(frame, p) == "column"]
    if heads:
        raise PlanError(
            f"Model.apply got labels=, so the model computes its own loss from the logits of "
            f"{heads[0]!r}, which tensor_parallel(loss_parallel=True) leaves sharded over the "
            f"vocab on {layout.axis!r} (a DTensor that F.cross_entropy cannot take); call "
            "model.apply without labels and take d9d.losses.cross_entropy(out.logits[:, :-1], "
            "tokens[:, 1:]), which never gathers them, or build tensor_parallel(..., "
            "loss_parallel=False) to gather the whole logits on every rank"
        )


def check_heads(module: nn.Module, layout: ActivationLayout) -> None:
    """Raise unless the model's attention head counts divide by the tensor-parallel size."""
    config = getattr(module, "config", None)
    for name in ("n_heads", "n_kv_heads", "num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if isinstance(heads, int) and heads % layout.size:
            raise IndivisibleError(
                f"{name}={heads} does not divide over {layout.size} {layout.axis!r} ranks: "
                f"each rank computes whole heads; use a {layout.axis} size that divides {heads}"
            )
