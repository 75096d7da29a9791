"""What ``context_parallel`` refuses in a Hugging Face model.

Splitting the sequence over ranks is exact only when every op that mixes positions is an
attention that d9d runs as ring attention, with a mask and features ring attention has. A
model is refused by name, before its forward, when its blocks hold a module that mixes
positions by itself (a convolution over the sequence: Mamba, gated delta nets, short
convolutions; a recurrent cell; pooling) or its config says a layer is anything but
attention or per-token work (``layer_types``: ``linear_attention``, ``hybrid``, ``conv``,
...), or an attention chunk shorter than the sequence, or a ``"dynamic"`` RoPE past
``max_position_embeddings``; one call of the model is refused when it is given a padding
mask, positions or labels (which ``transformers`` would drop, read documents from, or shift
within the rank's slice); and one call of attention is refused when the module passes a
mask of its own, a dropout in training, an argument ring attention does not implement, or
a sliding window that disagrees with the one its config gives the layer (ring attention
computes causal sliding windows: :func:`attention_window` finds a call's).
A block that ran without calling the ``"d9d_ring"`` attention at all is refused after its
forward: its attention is its own code, which the switch of ``config._attn_implementation``
never reaches (OpenAI GPT, GPT-Neo); one that failed before calling it (not by a refusal of
d9d's) gets a note saying so. Anything unknown is refused: a new kind of layer or argument
fails safe.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ...core._structure import Block, Structure
from ...errors import PlanError

__all__ = [
    "attention_window",
    "check_attention_call",
    "check_block_attended",
    "check_hf_chunks",
    "check_hf_inputs",
    "check_hf_layers",
    "check_hf_rope",
    "per_token_layer",
    "unattended_failure_note",
]

# Leaf modules whose output at one position depends on other positions.
POSITION_MIXING: tuple[type[nn.Module], ...] = (
    nn.modules.conv._ConvNd,  # Mamba's, gated delta nets' and LFM's causal conv1d
    nn.RNNBase,
    nn.RNNCellBase,
    nn.MultiheadAttention,  # its own attention, not the attention interface
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
)

# config.layer_types values ring attention runs exactly (a chunk shorter than the sequence
# is refused per call: check_hf_chunks).
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
CHUNKED = "chunked_attention"  # Llama 4: attention within chunks of config.attention_chunk_size
PER_TOKEN_LAYERS = frozenset({"mlp", "moe"})  # Nemotron-H's layers without attention
# Why a known layer type is refused, where more can be said than that it mixes positions.
LAYER_REASONS: dict[str, str] = {
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-MoE-DSA, AXK2, Dots3-Note, HY-V4).
    "indexed_attention": (
        "picks each query's top-k keys among all the sequence's positions (a top-k indexer "
        "scoring every key) and passes attention that choice as a mask, which ring attention, "
        "each rank holding its part of the keys and masking causally only, does not implement"
    ),
}

# Arguments transformers passes attention that change nothing in its math.
INERT_ARGUMENTS = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "past_key_values",
        "past_key_value",
        "cache",
        "layer_idx",
    }
)
# Arguments the ring attention call itself takes (sliding_window is checked against the config
# by attention_window; s_aux are attention sinks, GPT-OSS's).
HANDLED_ARGUMENTS = frozenset({"sliding_window", "is_causal", "s_aux"})

_DROP_CP = "train this model without context_parallel"
HF_ATTENTION = "d9d_ring"  # the attention implementation transformers is switched to


def check_hf_layers(structure: Structure, config: Any) -> None:
    """Refuse a model whose blocks mix positions outside attention (module or layer type)."""
    blocks = structure.blocks or ()
    roots = [(b.path, b.module) for b in blocks] or [("", structure.module)]
    for root, block in roots:
        for name, leaf in block.named_modules():
            if isinstance(leaf, POSITION_MIXING):
                path = f"{root}.{name}" if root and name else root or name
                owner_path, owner = _owner(structure, root, path)
                raise PlanError(
                    f"{owner_path} ({type(owner).__name__}) mixes positions outside attention: "
                    f"it holds {path} ({type(leaf).__name__}), which context_parallel cannot "
                    "split over the sequence (only attention runs over the whole sequence, as "
                    f"ring attention); {_DROP_CP}"
                )
    layer_types = getattr(config, "layer_types", None)
    if not isinstance(layer_types, (list, tuple)):
        return
    for index, kind in enumerate(layer_types):
        if kind in ATTENTION_LAYERS or kind in PER_TOKEN_LAYERS:
            continue
        where = (
            f"{blocks[index].path} ({type(blocks[index].module).__name__}) is"
            if index < len(blocks)
            else f"layer {index} is"
        )
        reason = LAYER_REASONS.get(
            kind, "mixes positions outside attention or in a way ring attention does not implement"
        )
        raise PlanError(
            f"{where} a {kind!r} layer (config.layer_types[{index}]), which {reason}; "
            f"context_parallel can split only {sorted(ATTENTION_LAYERS)} and per-token "
            f"{sorted(PER_TOKEN_LAYERS)} layers; {_DROP_CP}"
        )


def check_hf_chunks(config: Any, seq_len: int) -> None:
    """Refuse an attention chunk (``config.attention_chunk_size``) shorter than the whole
    sequence (``seq_len``): transformers builds it as a mask, which ring attention does not
    apply. A config with ``layer_types`` is read only if it has chunked layers."""
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)):
        if CHUNKED not in layer_types:
            return
        what = f"{CHUNKED!r} layers"
    else:
        what = "attention layers"
    chunk = getattr(config, "attention_chunk_size", None)
    if isinstance(chunk, int) and chunk < seq_len:
        raise PlanError(
            f"the model has {what} over {chunk} positions (config.attention_chunk_size="
            f"{chunk}), shorter than the sequence ({seq_len}), which context_parallel's ring "
            "attention does not support; train on sequences no longer than that, or without "
            "context_parallel"
        )


def _shorter(window: Any, seq_len: int) -> int | None:
    """``window`` if it is an int shorter than ``seq_len``, else None (it changes nothing)."""
    return window if isinstance(window, int) and window < seq_len else None


def _builds_sliding_masks(module: nn.Module) -> bool:
    """Whether the model file of ``module`` builds masks with transformers' sliding window
    mask (``create_sliding_window_causal_mask``, from ``config.sliding_window``)."""
    source = sys.modules.get(type(module).__module__)
    return getattr(source, "create_sliding_window_causal_mask", None) is not None


def attention_window(module: nn.Module, given: Any, seq_len: int) -> int | None:
    """The causal sliding window of one call of attention over ``seq_len`` positions, None
    if it has none shorter: the window transformers builds the layer's mask with, which ring
    attention then computes (the ``sliding_window=`` the module passes, ``given``, must agree).

    transformers builds a sliding mask (``create_sliding_window_causal_mask``, which the
    module's model file must use) from ``config.sliding_window``, for a
    ``"sliding_attention"`` layer of ``config.layer_types`` (the layer being the module's
    ``layer_idx``) or for every layer of a config without ``layer_types``; PhiMoE and
    Qwen2-MoE pass attention no ``sliding_window=``, so the config's is used.

    Raises:
        PlanError: A window shorter than the sequence in a model file that does not build
            sliding masks (Moshi keeps its window for its cache), one that ``given``
            disagrees with, or one whose layer is not known (no ``layer_idx``).
    """
    config = getattr(module, "config", None)
    field = _shorter(getattr(config, "sliding_window", None), seq_len)
    given = _shorter(given, seq_len)
    if given is None and field is None:
        return None
    name = type(module).__name__
    if not _builds_sliding_masks(module):
        raise PlanError(
            f"{name} has a sliding window (sliding_window={given} passed to attention, "
            f"config.sliding_window={getattr(config, 'sliding_window', None)}) shorter than "
            f"the sequence ({seq_len}), but its model file ({type(module).__module__}) builds "
            "no mask with transformers' create_sliding_window_causal_mask, so which keys it "
            f"attends to on one device is not known to context_parallel; {_DROP_CP}"
        )
    layer_types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if not isinstance(layer_types, (list, tuple)):
        expected = field
    elif isinstance(index, int) and 0 <= index < len(layer_types):
        expected = field if layer_types[index] == "sliding_attention" else None
    elif given is not None and given == field:
        expected = field
    else:
        raise PlanError(
            f"{name} has no layer_idx, so context_parallel cannot tell whether its layer is "
            "one of config.layer_types' 'sliding_attention' layers, whose mask transformers "
            f"builds with config.sliding_window={field} (shorter than the sequence, "
            f"{seq_len}; it passes attention sliding_window={given}); {_DROP_CP}"
        )
    if given is not None and given != expected:
        raise PlanError(
            f"{name} (layer {index}) passes attention sliding_window={given}, but transformers "
            f"builds the layer's mask with {expected} (from config.sliding_window="
            f"{getattr(config, 'sliding_window', None)} and its layer_types), over a sequence "
            f"of {seq_len}: context_parallel cannot tell which it attends over; {_DROP_CP}"
        )
    return expected


def check_hf_rope(config: Any, seq_len: int) -> None:
    """Refuse a ``"dynamic"`` RoPE over a sequence (``seq_len``) longer than
    ``config.max_position_embeddings``: transformers then rescales the rotary frequencies by
    the largest position id a call sees, which on a context_parallel rank is that of its part
    of the sequence, not the sequence's (so ranks would rotate by other frequencies than one
    device does)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return
    per_type = params if "rope_type" not in params else {None: params}
    limit = getattr(config, "max_position_embeddings", None)
    for layer_type, rope in per_type.items():
        rope_type = rope.get("rope_type") if isinstance(rope, dict) else None
        if (
            isinstance(rope_type, str)
            and "dynamic" in rope_type
            and not (isinstance(limit, int) and seq_len <= limit)
        ):
            where = "" if layer_type is None else f"[{layer_type!r}]"
            raise PlanError(
                f"the model's RoPE is {rope_type!r} (config.rope_parameters{where}), which "
                f"rescales its frequencies by the largest position id of a call once the "
                f"sequence ({seq_len}) exceeds config.max_position_embeddings={limit}: each "
                "context_parallel rank holds only a part of the positions, so ranks would "
                "rotate by other frequencies than one device; train on sequences no longer "
                "than max_position_embeddings, with another rope_type, or without "
                "context_parallel"
            )


def per_token_layer(config: Any, index: int) -> bool:
    """Whether ``config.layer_types`` says block ``index`` has no attention (an MLP or MoE
    layer), so that it calls no attention by design."""
    layer_types = getattr(config, "layer_types", None)
    if not isinstance(layer_types, (list, tuple)) or index >= len(layer_types):
        return False
    return layer_types[index] in PER_TOKEN_LAYERS


def check_block_attended(block: Block, calls: int) -> None:
    """Refuse a block of a Hugging Face model that ran without calling ring attention
    (``calls`` times it did): its attention, if it has one, is its own code (GPT-Neo's,
    OpenAI GPT's ``_attn``), which never reads ``config._attn_implementation`` and so attended
    over this rank's slice of the sequence only; a block without attention is not known to be
    per-token unless ``config.layer_types`` says so."""
    if calls:
        return
    raise PlanError(
        f"{block.path} ({type(block.module).__name__}) ran without calling attention through "
        "transformers' attention interface, which context_parallel switches to ring "
        f"attention ({HF_ATTENTION!r}): its attention is its own code (it does not read "
        "config._attn_implementation), which sees only this rank's slice of the sequence, "
        "or it has none and config.layer_types does not say it is per-token "
        f"({sorted(PER_TOKEN_LAYERS)}); {_DROP_CP}"
    )


def unattended_failure_note(block: Block) -> str:
    """The note added to an error a Hugging Face block raised before it called ring attention:
    the likely cause is attention code of its own, which meets what ``"d9d_ring"`` changes
    (Falcon's eager attention adds the mask transformers builds for names it knows, and
    found None: ``TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType'``)."""
    return (
        f"context_parallel: {block.path} ({type(block.module).__name__}) raised this before "
        "calling attention through transformers' attention interface, which "
        f"context_parallel switches to ring attention ({HF_ATTENTION!r}, for which "
        "transformers builds no mask): if its attention is its own code (it reads "
        "config._attn_implementation for the names it knows only), context_parallel cannot "
        f"split it; {_DROP_CP}"
    )


# Inputs of a model's forward that a rank's slice of the sequence would silently get wrong.
SEQUENCE_INPUTS: dict[str, str] = {
    "attention_mask": (
        "transformers builds no mask for the 'd9d_ring' attention, so a padding mask would be "
        "dropped (ring attention applies causality over global positions only); leave it out "
        "(an all-ones mask changes nothing), pad on the right and label padded positions -100"
    ),
    "position_ids": (
        "transformers reads packed sequences from them (a position that does not follow the "
        "one before starts a document) and masks attention between the documents, a mask "
        "ring attention does not apply; leave them out: context_parallel passes the rank's "
        "global positions itself"
    ),
    "labels": (
        "transformers' own loss shifts the labels by one within this rank's slice of each "
        "sequence, not within the sequence, so the tokens at the slice's cuts would be scored "
        "against the wrong next token, and its mean is this rank's; take .logits and "
        "d9d.losses.cross_entropy with the batch's labels (shifted by the loader)"
    ),
}


def check_hf_inputs(structure: Structure, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a model call given a padding mask, positions or labels of its own
    (:data:`SEQUENCE_INPUTS`)."""
    given = structure.given_inputs(args, kwargs)
    for name, why in SEQUENCE_INPUTS.items():
        value = given.get(name)
        if value is not None:
            what = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else value
            raise PlanError(
                f"{type(structure.module).__name__} was given {name} ({what}), which "
                f"context_parallel cannot split: {why}"
            )


def check_attention_call(
    module: nn.Module, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> None:
    """Refuse one call of attention whose mask or arguments ring attention does not apply."""
    name = type(module).__name__
    if attention_mask is not None:  # "d9d_ring" has no mask function: the module built it
        raise PlanError(
            f"{name} passes attention a mask of its own (shape {tuple(attention_mask.shape)}: "
            "a dynamic or learned mask, or padding), which context_parallel's ring attention "
            f"does not apply (it applies causality over global positions only); {_DROP_CP}"
        )
    if kwargs.get("softcap") is not None:
        raise PlanError(
            f"{name} soft-caps its attention scores (softcap={kwargs['softcap']}), which "
            "context_parallel's ring attention does not do; build the model with "
            "attn_logit_softcapping=None, or train it without context_parallel"
        )
    unknown = sorted(
        key
        for key, value in kwargs.items()
        if value is not None and key not in INERT_ARGUMENTS | HANDLED_ARGUMENTS
    )
    if unknown:
        raise PlanError(
            f"{name} passes attention {unknown}, which context_parallel's ring attention "
            f"does not implement (it takes only {sorted(HANDLED_ARGUMENTS)} besides "
            f"q, k, v, scaling and dropout=0); {_DROP_CP}"
        )


def _owner(structure: Structure, root: str, path: str) -> tuple[str, nn.Module]:
    """The child of the block ``root`` that holds ``path`` (the block, for its own child)."""
    parts = (path[len(root) + 1 :] if root else path).split(".")
    owner = f"{root}.{parts[0]}" if root and len(parts) > 1 else root or path
    return owner, structure.module.get_submodule(owner)
