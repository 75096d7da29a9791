"""The children of a Hugging Face model's blocks that tensor parallelism keeps whole.

``transformers``' own tensor parallelism replicates a module its tp plan does not name: every
tp rank computes it whole, on the same input, to the same output. That is exact for a child
of a block, which the block calls on its residual stream (whole on every rank once sequence
parallelism is off), and d9d does the same where no rule could shard the module exactly:

- a block child that holds an ``nn.Conv1d`` (a mamba or gated-delta-net mixer's causal
  convolution, a short convolution), which ``tensor_parallel`` cannot shard: whole with every
  param of it, what the plan says of its projections too (their row ranges are packed
  ``q|k|v`` groups the convolution's channels would have to follow);
- a block child (or a module beside the blocks, Qwen4-exp's ``hyper_connection_mixer``)
  holding no column-parallel weight, so that nothing in it is sharded: a
  mixer the plan leaves out (MiniMax's linear attention, whose ``qkv_proj`` nothing names,
  NemotronH's attention and MLP layers), or an attention the plan keeps whole
  (``colwise_gather_output``) with per-head norms that d9d's rules name ``head_dim``, whose
  grads ``tensor_parallel`` would sum over ranks that each computed all heads (MiniMax-M3:
  rel 1.1 off, no error). Its params named only ``embed``, ``experts`` or ``expert_mlp``
  keep their names (routed experts stay ``experts`` for ``expert_parallel``).

A module whose ``forward`` computes without grad (``torch.no_grad()``: the top-k indexer of
DeepSeek Sparse Attention, ``self_attn.indexer``) is kept whole wherever it sits in a block
child, a head-sharded attention included: it reads the attention's whole input and what whole
params compute from it, so every rank picks one device's top-k keys, and nothing it outputs
carries a grad, so its params get none and no input grad flows back through it
(``tensor_parallel`` lets its weights sit beside column-parallel linears for that reason).

An ``nn.Embedding`` that holds params besides its weight (Inkling's normed embedding) is kept
whole too: vocab-parallel, its forward would apply them to the rank's rows of the lookup
(``tensor_parallel`` refuses that by name).

Their params get ``("embed",) * ndim``: replicated over tp, their grads identical on every
rank without sequence parallelism; with it, ``tensor_parallel`` refuses such a module by name
(it would run on ``S / tp`` positions) and says to use ``sequence_parallel=False``. A param
that no rule names inside a module the plan does shard (DiffLlama's lambdas, on head-sharded
activations) stays refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from torch import nn

from ..core._grad_mode import computes_without_grad
from ._pp_plan import block_lists_for
from ._tp_plan import generalize

__all__ = ["kept_whole_rules"]

Axes = tuple[str | None, ...]

# Logical axes on dim 0 of a column-parallel weight: a child holding one is sharded by its rules.
_COLUMN = ("heads", "kv_heads", "mlp")
# Logical axes whole on tp whose grads are not partial sums: a kept-whole child's params named
# with only these keep their names (routed experts stay "experts" for expert_parallel).
_WHOLE = {"embed", "experts", "expert_mlp"}


def kept_whole_rules(module: nn.Module, rules: Mapping[str, Axes]) -> dict[str, Axes]:
    """``{param path regex: ("embed",) * ndim}`` for every param of a block child of
    ``module`` that holds an ``nn.Conv1d``, and for the params of a block child that holds
    no weight ``rules`` make column-parallel, but those ``rules`` name with axes whole on tp
    only; for every param of a module in a block child that computes without grad; and
    ``("embed", "embed")`` for the weight of an ``nn.Embedding`` that holds other params (see
    the module docstring)."""
    compiled = [(re.compile(pattern), axes) for pattern, axes in rules.items()]

    def axes_of(key: str) -> Axes | None:
        return next((axes for rule, axes in compiled if rule.search(key)), None)

    kept: dict[str, Axes] = {}
    for path, child in _block_children(module):
        params = [(f"{path}.{name}", p) for name, p in child.named_parameters()]
        found = [axes_of(key) for key, _ in params]
        convolves = any(isinstance(m, nn.Conv1d) for m in child.modules())
        column = any(axes is not None and axes[0] in _COLUMN for axes in found)
        if convolves:
            kept.update({_exact(key): ("embed",) * p.ndim for key, p in params})
            continue
        for inner, indexer in child.named_modules(prefix=path):
            if computes_without_grad(indexer):  # a top-k indexer: same indices on every rank
                named = indexer.named_parameters(prefix=inner)
                kept.update({_exact(key): ("embed",) * p.ndim for key, p in named})
        if not column:  # what its rules keep whole (experts) stays named
            kept.update(
                {
                    _exact(key): ("embed",) * p.ndim
                    for (key, p), axes in zip(params, found, strict=True)
                    if axes is None or not set(axes) <= _WHOLE
                }
            )
    for path, embedding in module.named_modules():  # its own params see the rank's rows only
        if isinstance(embedding, nn.Embedding) and len(list(embedding.parameters())) > 1:
            kept[_exact(f"{path}.weight")] = ("embed", "embed")
    return generalize(kept)


def _exact(key: str) -> str:
    return "^" + re.escape(key) + "$"


def _block_children(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(path, child)`` of each child of each block, then of each module beside the blocks
    in the module that holds them (Qwen4-exp's ``hyper_connection_mixer``), but embeddings."""
    lists = _lists(module)
    for list_path in lists:
        for name, block in module.get_submodule(list_path).named_children():
            for child_name, child in block.named_children():
                yield f"{list_path}.{name}.{child_name}", child
    for owner in sorted({path.rpartition(".")[0] for path in lists}):
        for name, child in module.get_submodule(owner).named_children():
            if not isinstance(child, (nn.ModuleList, nn.Embedding)):
                yield f"{owner}.{name}" if owner else name, child


def _lists(module: nn.Module) -> tuple[str, ...]:
    """The ``nn.ModuleList``s the model's pp plan names, else its outermost ones."""
    lists = block_lists_for(module)
    if lists:
        return lists
    outer: list[str] = []
    for path, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and not any(path.startswith(p + ".") for p in outer):
            outer.append(path)
    return tuple(outer)
