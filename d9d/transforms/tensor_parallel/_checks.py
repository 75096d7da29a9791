"""What ``tensor_parallel`` checks before it runs a model: that every param sharded over its
axis belongs to a module it knows how to run on a shard, that a module given its input whole
holds no weight whose grad that would count twice, that only position-wise modules run on part
of the sequence, that head counts divide, and that no loss needs the whole logits (or router
logits) it leaves sharded."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Partial, Shard

from ...core._param_plan import ParamPlan
from ...core._structure import Structure
from ...errors import IndivisibleError, PlanError
from ..expert_parallel import is_expert_weight
from ._layout import HEAD_AXES, PARTIAL_GRAD_AXES, ActivationLayout

# Logical axes of a one-dim param that a module holding column-parallel linears reads beside
# their output shards (sinks per head, a head's per-token logit scale).
_BESIDE_COLUMNS = (*HEAD_AXES, "vocab")

__all__ = [
    "check_embedding",
    "check_heads",
    "check_modules",
    "check_own_loss",
    "check_region",
    "check_router_logits",
]


def _by_path(structure: Structure, entries: Mapping[str, ParamPlan]) -> dict[str, ParamPlan]:
    """``entries`` under every path of a param, tied aliases included: its ``.get(path)`` is
    ``entries.get(structure.canonical(path))``, resolved once for all the checks (not once per
    check)."""
    tied = structure.tied
    own = {path: entry for path, entry in entries.items() if path not in tied}
    return own | {alias: entries[key] for alias, key in tied.items() if key in entries}


def check_embedding(path: str, module: nn.Embedding) -> None:
    """Raise for options whose effect depends on rows outside the local vocab shard, and for
    an embedding whose forward does more than the lookup with params of its own (a norm):
    they would act on the rank's rows of it, zeros elsewhere, before the sum over ranks."""
    others = [name for name, _ in module.named_parameters() if name != "weight"]
    if others:
        raise PlanError(
            f"embedding {path!r} ({type(module).__name__}) holds params besides its weight "
            f"({others}), which its forward would apply to this rank's rows of a vocab-parallel "
            "lookup only (zeros elsewhere): their grads would miss the other ranks' tokens; "
            "keep it whole on the axis with logical axes that map to no mesh axis (e.g. "
            f"functionalize(module, axes={{{re.escape(path + '.weight') + '$'!r}: "
            "('embed', 'embed')}))"
        )
    if module.max_norm is not None or module.scale_grad_by_freq:
        raise PlanError(
            f"embedding {path!r} has max_norm={module.max_norm} and "
            f"scale_grad_by_freq={module.scale_grad_by_freq}, which a vocab-parallel lookup "
            "cannot honour (each rank sees only its rows); build it without them, or keep it "
            "whole on the axis with logical axes that map to no mesh axis (e.g. "
            "('embed', 'embed'))"
        )


def check_region(path: str, region: tuple[str, ...], roles: set, module: nn.Module) -> None:
    if "row" not in roles and not isinstance(module, nn.Linear):
        raise PlanError(
            f"module {path!r} holds column-parallel linears but no row-parallel one, so its "
            "output would stay sharded; shard the linear that consumes them on its input "
            f"dim (linears here: {list(region)})"
        )


def check_modules(
    structure: Structure,
    regions: Mapping[str, tuple[str, ...]],
    entries: Mapping[str, ParamPlan],
    layout: ActivationLayout,
) -> None:
    """Raise, before any collective, for params the runtime cannot lay out: see
    :func:`_check_sharded`, :func:`_check_whole_beside_sharded`,
    :func:`_check_sequence_regions` and :func:`_check_root_params`, which take the plan's
    ``entries`` under every path (:func:`_by_path`)."""
    entries = _by_path(structure, entries)
    _check_sharded(structure, regions, entries, layout)
    _check_whole_beside_sharded(structure, regions, entries, layout)
    if layout.sequence_parallel:
        _check_sequence_regions(structure, regions, entries, layout)
        _check_root_params(structure, entries, layout)


def _whole_weights(
    structure: Structure,
    regions: Mapping[str, tuple[str, ...]],
    entries: Mapping[str, ParamPlan],
    layout: ActivationLayout,
) -> Iterator[tuple[str, str, set[int]]]:
    """``(region, param path, dims)`` of each weight (2 dims or more) whole on the axis inside
    a region, ``dims`` the dims on which the region's linear weights are sharded (0: it holds
    a column-parallel linear, 1: a row-parallel one)."""

    def placement(key: str) -> Any:
        entry = entries.get(key)
        return entry.compute[layout.index] if entry is not None else None

    for slot in structure.slots:
        parts = slot.key.split(".")
        prefixes = (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1))
        region = next((p for p in prefixes if p in regions), None)
        entry = entries.get(slot.key) if slot.is_param else None
        if region is None or entry is None or len(entry.shape) < 2:
            continue
        if isinstance(placement(slot.key), Shard):
            continue
        linears = (placement(f"{linear}.weight") for linear in regions[region])
        yield region, slot.key, {p.dim for p in linears if isinstance(p, Shard)}


def _check_whole_beside_sharded(
    structure: Structure,
    regions: Mapping[str, tuple[str, ...]],
    entries: Mapping[str, ParamPlan],
    layout: ActivationLayout,
) -> None:
    """A region holding column-parallel linears gets its input whole on every rank and its
    input grad summed over the axis: right for what the sharded linears compute, ``tp`` times
    too much for a weight whole on the axis beside them. Raise for such a weight, but in a
    module that computes without grad (``Structure.without_grad``: a sparse attention's top-k
    indexer), through which no grad flows."""
    gradless = tuple(p + "." for p in structure.without_grad)
    for region, key, dims in _whole_weights(structure, regions, entries, layout):
        axes = entries[key].axes or ()
        if 0 not in dims or any(name in PARTIAL_GRAD_AXES for name in axes):
            continue  # a per-head weight's input grad is partial: the sum is exact
        if key.startswith(gradless):
            continue  # no grad reaches the weight nor flows back through it
        raise PlanError(
            f"module {region!r} holds column-parallel linears and {key!r} whole on "
            f"{layout.axis!r}: tensor_parallel gives the module its input whole and sums its "
            f"input grad over {layout.axis!r}, which would count the input grad through that "
            f"weight {layout.size} times; shard it too, keep the module's linears whole (logical axes "
            "that map to no mesh axis), or, if the module computes each position on its own, "
            "declare it position-wise (an attribute position_wise = True) so that its children "
            "holding the sharded linears get their input whole instead (d9d.moe.MoE declares "
            "it when it drops no token: capacity_factor=None)"
        )


def _check_root_params(
    structure: Structure, entries: Mapping[str, ParamPlan], layout: ActivationLayout
) -> None:
    """Under sequence parallelism a param used before the first block, where the sequence is
    whole on every rank, would have its grad summed over the axis; the runtime finds such a
    use when the module owning the param runs, which it cannot intercept for the model's root
    module. Raise for a param the root holds itself whose grad the axis sums."""
    summed = [
        key
        for key in structure.root_owners.get("", ())
        if isinstance(entries[key].grad[layout.index], Partial)
    ]
    if summed:
        raise PlanError(
            f"params {summed} are held by the model's root module "
            f"({type(structure.module).__name__}) itself, so tensor_parallel cannot tell "
            "whether they are used before the first block, where the sequence is whole on "
            f"every {layout.axis!r} rank and sequence parallelism would sum their grads over "
            "them; move them into a child module whose forward uses them, or use "
            "tensor_parallel(..., sequence_parallel=False)"
        )


def _check_sequence_regions(
    structure: Structure,
    regions: Mapping[str, tuple[str, ...]],
    entries: Mapping[str, ParamPlan],
    layout: ActivationLayout,
) -> None:
    """Under sequence parallelism a region with no sharded linear runs on ``S / tp``
    positions: right for a norm or a position-wise module (``Structure.position_wise``),
    wrong for attention or a head. Raise for a weight (2 dims or more) whole on the axis in
    such a region, outside every position-wise module."""
    position_wise = tuple(p + "." for p in structure.position_wise)
    for region, key, dims in _whole_weights(structure, regions, entries, layout):
        if dims or key.startswith(position_wise):
            continue
        raise PlanError(
            f"module {region!r} holds {key!r} whole on {layout.axis!r} and no sharded "
            "nn.Linear, so under sequence parallelism it would run on this rank's "
            f"S / {layout.size} positions only (wrong for attention, or for a head whose loss "
            "the ranks do not sum); shard its linears (logical axes heads, mlp, vocab), declare "
            "the module position-wise if it computes each position on its own (an attribute "
            "position_wise = True), or use tensor_parallel(..., sequence_parallel=False)"
        )


def check_router_logits(
    structure: Structure, layout: ActivationLayout, kwargs: Mapping[str, Any]
) -> None:
    """Raise when a Hugging Face MoE model is asked for its router logits (from which
    ``transformers`` computes its own aux loss) while sequence parallelism runs its
    position-wise MoE blocks on ``S / tp`` positions: each rank would get its positions'."""
    if not layout.sequence_parallel or not structure.position_wise:
        return
    config = getattr(structure.module, "config", None)
    asked = kwargs.get("output_router_logits")
    if asked is None:
        asked = getattr(config, "output_router_logits", False)
    if asked is True:
        raise PlanError(
            f"the model is asked for its router logits (output_router_logits=True), but "
            f"under sequence parallelism its position-wise module "
            f"{structure.position_wise[0]!r} runs on this rank's S / {layout.size} positions "
            "only, so its router logits, and the aux loss transformers computes from them, "
            "would be this rank's; call it with output_router_logits=False (d9d.moe's layers "
            "sum their statistics over the ranks themselves), or use tensor_parallel(..., "
            "sequence_parallel=False)"
        )


def _check_sharded(
    structure: Structure,
    regions: Mapping[str, tuple[str, ...]],
    entries: Mapping[str, ParamPlan],
    layout: ActivationLayout,
) -> None:
    """Raise unless every param sharded over the axis belongs to a module whose shard the
    runtime knows how to use: an ``nn.Linear``'s weight (column- or row-parallel) or a
    column-parallel linear's bias, an ``nn.Embedding``'s weight over the vocab, or a
    one-dim param of heads or of the vocab (``heads``, ``kv_heads``, ``vocab``) of a module
    holding column-parallel linears (an attention's sinks or gate bias, Dory's head's
    per-token logit scale: its forward reads them beside the rank's shard of those linears'
    outputs)."""

    def holds_column_linears(path: str) -> bool:
        weights = (entries.get(f"{p}.weight") for p in regions.get(path, ()))
        return any(w is not None and w.compute[layout.index] == Shard(0) for w in weights)

    for slot in structure.slots:
        entry = entries.get(slot.key)
        placement = entry.compute[layout.index] if slot.is_param and entry is not None else None
        if not isinstance(placement, Shard):
            continue
        owner, name = slot.owner, slot.name
        weight_key = f"{slot.key.rpartition('.')[0]}.weight"
        weight = entries.get(weight_key)
        column = weight is not None and weight.compute[layout.index] == Shard(0)
        match owner, name, placement.dim:
            case nn.Linear(), "weight", 0 | 1:
                continue
            case nn.Linear(), "bias", 0 if column:
                continue
            case nn.Embedding(), "weight", 0:
                continue
        path = slot.key.rpartition(".")[0]
        if (
            len(entry.shape) == 1
            and entry.axes[0] in _BESIDE_COLUMNS
            and holds_column_linears(path)
        ):
            continue
        raise PlanError(
            f"param {slot.key!r} is sharded over {layout.axis!r} (dim {placement.dim}, logical "
            f"axis {entry.axes[placement.dim]!r}), but its module {path!r} "
            f"({type(owner).__name__}) is not one tensor_parallel knows how to run on a "
            "shard: it shards nn.Linear weights (column- or row-parallel), a column-parallel "
            "linear's bias and nn.Embedding weights over the vocab. "
            + _keep_whole_fix(slot.key, entry, layout.axis)
        )


def _keep_whole_fix(key: str, entry: ParamPlan, axis: str) -> str:
    """How to keep the param at ``key`` whole on ``axis``: routed experts by leaving their
    axes out of the rules (their logical axes are what ``expert_parallel`` reads), any other
    param by axes that map to no mesh axis."""
    if is_expert_weight(entry):
        return (
            f"Routed experts stay whole on {axis!r}: map neither 'experts' nor 'expert_mlp' "
            f"to {axis!r} in tensor_parallel's rules, and shard the experts over an ep axis "
            "with d9d.expert_parallel"
        )
    return (
        f"Keep this param whole on {axis!r}: give it logical axes that map to no mesh axis "
        f"(e.g. functionalize(module, axes={{{_rule(key)!r}: {('embed',) * len(entry.shape)}}})). "
        "(A transformers Conv1D is a transposed linear, and a fused q/k/v weight splits per "
        "head group, not per row range.)"
    )


def _rule(key: str) -> str:
    """An ``axes=`` pattern for the param at ``key``: its module's name and its own."""
    module, _, name = key.rpartition(".")
    return re.escape(f"{module.rpartition('.')[2]}.{name}") + "$"


def check_own_loss(heads: list[str], layout: ActivationLayout, kwargs: dict[str, Any]) -> None:
    """Raise when the model is asked for its own loss (``labels=``) while its head returns
    vocab-sharded logits (``heads``: the column-parallel linears outside blocks), which a loss written for whole logits (``F.cross_entropy``) cannot
    take."""
    if not layout.loss_parallel or kwargs.get("labels") is None:
        return
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
