"""Tensor-parallel activations: the collectives at module boundaries, as Megatron places them.

Blocks compute on local tensors: the param shards their plan gives them. During each
``Model.apply`` this runtime intercepts the modules where a boundary needs activations moved
between layouts. Roles come from the plan: an ``nn.Linear`` whose weight is ``Shard(0)`` on
the tensor-parallel axis is column-parallel, ``Shard(1)`` row-parallel, an ``nn.Embedding``
with ``Shard(0)`` vocab-parallel. A *region* is a child of a block (``attn``, ``mlp``) or a
linear outside any block (the output head).

- A region holding column-parallel linears gets its input whole: an all-gather of the sequence
  shards (sequence parallel; its backward is a reduce-scatter) or, without sequence
  parallelism, the identity whose backward all-reduces.
- A row-parallel linear's output is a partial sum: reduce-scattered over the sequence
  (sequence parallel) or all-reduced. Its bias is added after that reduction.
- A column-parallel linear outside blocks (the head) returns its vocab shard as a DTensor
  ``Shard(-1)`` (loss parallel: ``d9d.losses.cross_entropy`` never gathers it) or all-gathered.
- A vocab-parallel embedding looks up the ids in its rows, zeroes the others and all-reduces;
  one whose own forward computes the ids it looks up does so at its table's lookup
  (``_table_lookups``).
- With sequence parallelism the first block slices the residual stream over the sequence
  (dim 1): model code between the embedding and the blocks (masks and positions) sees the
  whole sequence, and every block after it sees ``S / tp`` positions.
- A block child the model declares position-wise (``Structure.position_wise``: an MoE layer)
  is no region itself: it runs on the input it gets, and its children are regions instead
  (its shared experts gather their input, its routed experts and router do not). Under
  sequence parallelism it runs on ``S / tp`` positions, with the step context's
  ``sequence_groups`` naming the axis, over which it sums its statistics.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Partial, Shard

from ...core._context import current
from ...core._embedding_ids import checked_ids, looks_up_its_input
from ...core._plan import Plan
from ...core._runtime import ApplyCall, Interception, Runtime, replace_activation
from ...core._structure import Structure, block_paths
from ...errors import PlanError
from ._checks import (
    check_embedding,
    check_heads,
    check_modules,
    check_own_loss,
    check_region,
    check_router_logits,
)
from ._layout import ActivationLayout
from ._random_draws import check_random_draws
from ._sequence_sources import sources
from ._table_lookups import around_table_lookups

__all__ = ["TensorParallelRuntime"]


@dataclass(frozen=True)
class _Roles:
    """What the runtime does in one model under one plan: module paths by role."""

    modules: dict[str, nn.Module]
    column_regions: tuple[str, ...]
    rows: tuple[str, ...]
    heads: tuple[str, ...]
    embeddings: tuple[str, ...]
    split: tuple[str, ...]  # position-wise modules that run on the rank's positions (SP)


@dataclass(eq=False)
class _Call:
    """One ``Model.apply`` in progress: whether the residual stream is sequence-sharded yet,
    and what pre-forward work swapped out of modules until their forward ends."""

    call: ApplyCall
    layout: ActivationLayout
    modules: dict[str, nn.Module]
    sequence_sharded: bool = False
    stash: dict[str, Any] = field(default_factory=dict)


class TensorParallelRuntime(Runtime):
    """The runtime of ``tensor_parallel``: intercepts blocks, regions, linears and
    embeddings of each ``Model.apply``."""

    def __init__(self, layout: ActivationLayout, plan: Plan) -> None:
        self.layout = layout
        self.plan = plan
        self._sequence_groups = ((layout.mesh.get_group().group_name, layout.size),)
        # Per model structure (held, so that its id is not reused), found on its first apply.
        self._roles: dict[int, tuple[Structure, _Roles]] = {}

    def roles(self, structure: Structure) -> _Roles:
        """The roles of ``structure``'s modules; checked (before any collective) the first
        time. Found anew while ``d9d.jit`` traces, so that the compiled step does not guard
        on this cache (filled by its first trace, it would be traced again)."""
        if torch.compiler.is_compiling():
            return self._checked_roles(structure)
        known = self._roles.get(id(structure))
        if known is not None:
            return known[1]
        found = self._checked_roles(structure)
        self._roles[id(structure)] = (structure, found)
        return found

    def _checked_roles(self, structure: Structure) -> _Roles:
        regions = _regions(structure.module, structure.position_wise)
        check_modules(structure, regions, self.plan.entries, self.layout)
        check_heads(structure.module, self.layout)
        return self._find_roles(structure, regions)

    def _find_roles(self, structure: Structure, regions: dict[str, tuple[str, ...]]) -> _Roles:
        def role(path: str) -> str | None:
            entry = self.plan.entries.get(structure.canonical(f"{path}.weight"))
            placement = entry.compute[self.layout.index] if entry is not None else None
            if isinstance(placement, Shard):
                return "column" if placement.dim == 0 else "row"
            return None

        modules = structure.modules
        column_regions = []
        for path, linears in regions.items():
            roles = {role(linear) for linear in linears}
            module = modules[path]
            if "column" in roles:
                check_region(path, linears, roles, module)
                column_regions.append(path)
            elif "row" in roles:
                raise PlanError(
                    f"module {path!r} holds row-parallel linears but no column-parallel one: "
                    "tensor_parallel shards a column-parallel linear's output (heads, mlp) and "
                    "the row-parallel linear after it; check the logical axes of its params"
                )
        linears = [p for p, m in modules.items() if isinstance(m, nn.Linear)]
        embeddings = []
        for path, module in modules.items():
            if isinstance(module, nn.Embedding) and self._embedding_sharded(structure, path):
                check_embedding(path, module)
                embeddings.append(path)
        # Position-wise modules in blocks that get their input as it comes: sequence-sharded
        # under sequence parallelism (not those inside a region that gathers it whole).
        blocks = tuple(b.path + "." for b in structure.blocks)
        gathered = tuple(column_regions)
        split = [
            p
            for p in structure.position_wise
            if p.startswith(blocks)
            and not any(p == r or p.startswith(r + ".") for r in gathered)
            and not any(p.startswith(q + ".") for q in structure.position_wise)
        ]
        return _Roles(
            modules=modules,
            column_regions=tuple(column_regions),
            rows=tuple(p for p in linears if role(p) == "row"),
            heads=tuple(p for p in linears if p in regions and role(p) == "column"),
            embeddings=tuple(embeddings),
            split=tuple(split),
        )

    def _embedding_sharded(self, structure: Structure, path: str) -> bool:
        layout = self.layout
        key = structure.canonical(f"{path}.weight")
        entry = self.plan.entries.get(key)
        placement = entry.compute[layout.index] if entry is not None else None
        if isinstance(placement, Shard) and placement.dim != 0:
            raise PlanError(
                f"embedding {key!r} is sharded over its embedding dim on {layout.axis!r}; "
                "tensor_parallel shards embeddings over the vocab: give it logical axes "
                "('vocab', 'embed')"
            )
        return isinstance(placement, Shard)

    def enter_apply(self, call: ApplyCall) -> None:
        roles = self.roles(call.structure)
        check_own_loss(list(roles.heads), self.layout, call.kwargs)
        check_router_logits(call.structure, self.layout, call.kwargs)
        check_random_draws(call.structure, self.layout)  # per call: a rate or train() may change
        state = _Call(call, self.layout, roles.modules)
        for block in call.structure.blocks:
            call.intercept(block.path, Interception(enter=functools.partial(_enter_block, state)))
        if self.layout.sequence_parallel:  # the root's own params: _check_root_params
            for owner in filter(None, call.structure.root_owners):
                enter = functools.partial(_enter_root_owner, state, owner)
                call.intercept(owner, Interception(enter=enter))
        for path in roles.column_regions:
            call.intercept(path, Interception(enter=functools.partial(_enter_region, state, path)))
        if self.layout.sequence_parallel:
            around = functools.partial(_around_split, state, self._sequence_groups)
            for path in roles.split:
                call.intercept(path, Interception(around=around))
        for path in roles.embeddings:
            module = roles.modules[path]
            if looks_up_its_input(module):
                lookup = Interception(
                    enter=functools.partial(_enter_embedding, state, path),
                    exit=functools.partial(_exit_embedding, state, path),
                )
            else:  # its forward computes what it looks up
                around = functools.partial(around_table_lookups, module, path, self.layout)
                lookup = Interception(around=around)
            call.intercept(path, lookup)
        for path in roles.rows:
            call.intercept(
                path,
                Interception(
                    enter=functools.partial(_enter_row, state, path),
                    exit=functools.partial(_exit_row, state, path),
                ),
            )
        for path in roles.heads:
            call.intercept(path, Interception(exit=functools.partial(_exit_head, state, path)))
        call.state[self] = state

    def exit_apply(self, call: ApplyCall) -> None:
        """Put back what pre-forward work swapped out of modules whose forward never ended
        (a forward that raised): an embedding's ``padding_idx``, a row-parallel bias."""
        state: _Call | None = call.state.get(self)
        if state is None:  # enter_apply raised
            return
        for path, stashed in state.stash.items():
            module = state.modules[path]
            if isinstance(module, nn.Embedding):
                module.padding_idx = stashed[1]
            else:
                module._parameters["bias"] = stashed
        state.stash.clear()


def _enter_block(state: _Call, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    """Slice the residual stream over the sequence when the first block starts."""
    layout = state.layout
    if not layout.sequence_parallel or state.sequence_sharded:
        return None
    state.sequence_sharded = True
    return replace_activation(args, kwargs, "block", functools.partial(_slice_sequence, state))


def _slice_sequence(state: _Call, x: torch.Tensor) -> torch.Tensor:
    """This rank's positions of the residual stream ``x``, once no param whose grad the axis
    sums is found among what ``x`` was computed from (eagerly: Dynamo traces no autograd
    graph; see ``_sequence_sources.py``)."""
    if not torch.compiler.is_compiling():
        for key in sources(x, _summed_root_params(state)):
            _refuse_before_blocks(key, state.layout)
    return state.layout.slice_sequence(x)


def _summed_root_params(state: _Call) -> dict[str, torch.Tensor]:
    """``{path: tensor in its slot}`` of the params outside blocks whose grad the axis sums."""
    structure, entries, index = state.call.structure, state.call.plan.entries, state.layout.index
    summed = {}
    for slot in structure.root_slots:
        key = structure.canonical(slot.key)
        tensor = slot.store()[slot.name]
        if isinstance(entries[key].grad[index], Partial) and isinstance(tensor, torch.Tensor):
            summed.setdefault(key, tensor)
    return summed


def _enter_root_owner(state: _Call, path: str, args: Any, kwargs: Any) -> None:
    """Raise for a param used before the first block whose grad sequence parallelism sums."""
    if state.sequence_sharded:
        return
    layout, plan = state.layout, state.call.plan
    for key in state.call.structure.root_owners[path]:
        if isinstance(plan.entries[key].grad[layout.index], Partial):
            _refuse_before_blocks(key, layout)


def _refuse_before_blocks(key: str, layout: ActivationLayout) -> None:
    raise PlanError(
        f"param {key!r} is used before the first block, where the sequence is whole on every "
        f"{layout.axis!r} rank, but sequence parallelism sums its grad over them; use "
        "tensor_parallel(..., sequence_parallel=False)"
    )


def _around_split(
    state: _Call, groups: tuple[tuple[str, int], ...], forward: Any, args: Any, kwargs: Any
) -> Any:
    """Run a position-wise module on this rank's positions, with ``groups`` (the axis) in the
    step context's ``sequence_groups`` for the length of its forward."""
    step = current()
    if step is None or not state.sequence_sharded:
        return forward(*args, **kwargs)
    previous = step.sequence_groups
    step.sequence_groups = previous + groups
    try:
        return forward(*args, **kwargs)
    finally:
        step.sequence_groups = previous


def _enter_region(state: _Call, path: str, args: Any, kwargs: Any) -> tuple[Any, Any]:
    layout = state.layout
    return replace_activation(
        args, kwargs, path, lambda x: layout.enter_region(x, state.sequence_sharded)
    )


def _enter_embedding(state: _Call, path: str, args: Any, kwargs: Any) -> tuple[Any, Any]:
    module = state.modules[path]
    # Ids past the vocab would match no rank's rows and come out as zero vectors: refused here.
    tokens = checked_ids(args[0], module.num_embeddings, path)
    first, count = state.layout.rows(module.num_embeddings)
    outside = (tokens < first) | (tokens >= first + count)
    # The padding row (no gradient) is global: local on the rank holding it, else none.
    state.stash[path] = outside, module.padding_idx
    module.padding_idx = _local_row(module.padding_idx, first, count)
    return ((tokens - first).masked_fill(outside, 0), *args[1:]), kwargs


def _exit_embedding(state: _Call, path: str, output: torch.Tensor) -> torch.Tensor:
    module = state.modules[path]
    outside, module.padding_idx = state.stash.pop(path)
    return state.layout.reduce_partial(output.masked_fill(outside.unsqueeze(-1), 0), False)


def _enter_row(state: _Call, path: str, args: Any, kwargs: Any) -> None:
    module = state.modules[path]
    if module.bias is not None:
        state.stash[path] = module._parameters["bias"]
        module._parameters["bias"] = None


def _exit_row(state: _Call, path: str, output: torch.Tensor) -> torch.Tensor:
    output = state.layout.reduce_partial(output, state.sequence_sharded)
    bias = state.stash.pop(path, None)
    if bias is None:
        # DTensor's to_local returns a view made in a custom autograd Function, which model
        # code may not modify in place (Llama-4's MoE adds its routed experts' output into
        # its shared expert's with out.add_): hand it a tensor of its own, as nn.Linear does.
        return output.clone()
    state.modules[path]._parameters["bias"] = bias
    return output + bias


def _exit_head(state: _Call, path: str, output: torch.Tensor) -> torch.Tensor:
    layout = state.layout
    features = state.modules[path].out_features
    if layout.loss_parallel:
        return layout.vocab_dtensor(output, features)
    return layout.gather_last_dim(output, features)


def _local_row(row: int | None, first: int, count: int) -> int | None:
    """Global ``row`` as an index into the local rows ``[first, first + count)``, or None."""
    return row - first if row is not None and first <= row < first + count else None


def _regions(module: nn.Module, position_wise: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Tensor-parallel regions, each with the linears inside it: every child of a block (one
    declared position-wise replaced by its children, recursively), and every linear outside
    blocks."""
    blocks = block_paths(module)
    linears = [p for p, m in module.named_modules() if isinstance(m, nn.Linear)]
    regions: dict[str, tuple[str, ...]] = {}

    def add(path: str, child: nn.Module) -> None:
        children = list(child.named_children())
        if path in position_wise and children:
            for name, grandchild in children:
                add(f"{path}.{name}", grandchild)
            return
        regions[path] = tuple(p for p in linears if p == path or p.startswith(path + "."))

    for block_path, block in blocks:
        for name, child in block.named_children():
            add(f"{block_path}.{name}", child)
    in_blocks = tuple(p + "." for p, _ in blocks)
    regions.update({p: (p,) for p in linears if not p.startswith(in_blocks)})
    return regions
