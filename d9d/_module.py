"""``functionalize``: an ``nn.Module`` as a pure ``apply(params, ...)`` with logical axes."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._active import active_plan
from ._gather import apply_placed, enter_block, enter_module, exit_block, exit_module
from ._sequence_split import position_kwarg
from .errors import ParamShapeError, ParamTreeMismatchError

__all__ = ["Axes", "Model", "functionalize"]

Axes = tuple[str | None, ...]
"""Logical axis names of one param, one per tensor dim; ``None`` names no axis."""

_DEFAULT_AXES: tuple[tuple[type[nn.Module], str, Axes], ...] = (
    (nn.Linear, "weight", ("out", "in")),
    (nn.Linear, "bias", ("out",)),
    (nn.Embedding, "weight", ("vocab", "embed")),
    (nn.LayerNorm, "weight", ("embed",)),
    (nn.LayerNorm, "bias", ("embed",)),
    (nn.RMSNorm, "weight", ("embed",)),
)


@dataclass(frozen=True, eq=False)
class _Slot:
    """Where one tensor lives in the module: ``owner._parameters[name]`` or ``_buffers``."""

    key: str
    owner: nn.Module
    name: str
    is_param: bool

    def store(self) -> dict[str, Any]:
        """The owner's dict that holds this tensor."""
        return self.owner._parameters if self.is_param else self.owner._buffers


@dataclass(frozen=True, eq=False)
class Model:
    """A module seen as a pure function of a flat params dict.

    Attributes:
        module: The wrapped module; ``apply`` swaps tensors in for one call and restores them.
        params: ``{path: tensor}`` of every distinct param (tied aliases appear once).
        buffers: ``{path: tensor}`` of every buffer, passed to each call.
        axes: ``{path: logical axis names}`` per param, one name (or ``None``) per dim.
        tied: ``{alias path: canonical path}`` for params shared between modules.
    """

    module: nn.Module
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    axes: dict[str, Axes]
    tied: dict[str, str] = field(default_factory=dict)
    _slots: tuple[_Slot, ...] = field(default=(), repr=False)
    _blocks: tuple[tuple[nn.Module, tuple[_Slot, ...]], ...] = field(default=(), repr=False)
    _block_homes: tuple[tuple[str, nn.Module, str], ...] = field(default=(), repr=False)
    _root_slots: tuple[_Slot, ...] = field(default=(), repr=False)
    _buffer_slots: tuple[_Slot, ...] = field(default=(), repr=False)
    _regions: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    _root_owners: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    _position_kwarg: str | None = field(default=None, repr=False)

    def apply(self, params: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """Call the module's forward with ``params`` in place of its own tensors.

        Pure: the module's own params and buffers are restored afterwards, and the same inputs
        give the same outputs. Not thread-safe on one module: build a ``Model`` per thread.
        Inside a transformed step the params are DTensors and each is gathered to its compute
        layout when used: a block's params (a child of an ``nn.ModuleList``) when that block
        runs, the others when ``apply`` starts.

        Args:
            params: ``{path: tensor}`` with exactly the paths of ``self.params``.
            *args: Positional inputs of ``module.forward``.
            **kwargs: Keyword inputs of ``module.forward``.

        Returns:
            Whatever ``module.forward`` returns.

        Raises:
            ParamTreeMismatchError: ``params`` misses paths of the model or has extra ones.
            ParamShapeError: A param's (global) shape is not the model's.

        Example:
            >>> model = functionalize(torch.nn.Linear(3, 2))
            >>> model.apply(model.params, torch.ones(1, 3)).shape
            torch.Size([1, 2])
        """
        plan = active_plan()
        if plan is None:
            self.check_params(params)
        else:  # the params may be local shards here: the plan holds their global shapes
            entries = plan.entries
            self.check_params(
                {p: entries.get(p, leaf) for p, leaf in params.items()},
                subset=plan.pipeline is not None,
            )
        if plan is not None:
            return apply_placed(self, plan, params, args, kwargs)
        saved = []
        for slot in self._slots:
            store = slot.store()
            saved.append(store[slot.name])
            source = params if slot.is_param else self.buffers
            store[slot.name] = source[self.tied.get(slot.key, slot.key)]
        try:
            return self.module(*args, **kwargs)
        finally:
            for slot, old in zip(self._slots, saved, strict=True):
                slot.store()[slot.name] = old

    def check_params(self, params: Mapping[str, Any], *, subset: bool = False) -> None:
        """Raise unless ``params`` has the model's paths, each of the model's (global) shape.

        Run by ``apply`` before the forward; under ``d9d.jit`` it runs while the step is traced,
        so a wrong shape stops the compile with this error instead of a fake-tensor dump.

        Args:
            params: ``{path: anything with a global .shape}`` (tensors, DTensors, plan entries).
            subset: Accept a subset of the model's paths (a pipeline stage's params).

        Raises:
            ParamTreeMismatchError: Paths are missing (unless ``subset``) or unexpected.
            ParamShapeError: A param's shape is not the model's.
        """
        given, wanted = params.keys(), self.params.keys()
        if given != wanted and not (subset and given <= wanted):
            raise _mismatch(given, wanted)
        for path, leaf in params.items():
            want = self.params[path].shape
            if leaf.shape != want:
                raise ParamShapeError(
                    f"param {path!r} has shape {tuple(leaf.shape)} but the model's is "
                    f"{tuple(want)}; pass params built for this model (model.params, or a "
                    "checkpoint restored onto them)"
                )


def _mismatch(given: Any, wanted: Any) -> ParamTreeMismatchError:
    missing = sorted(set(wanted) - set(given))
    unexpected = sorted(set(given) - set(wanted))
    return ParamTreeMismatchError(
        f"params do not match the model: missing paths {_clip(missing)}, "
        f"unexpected paths {_clip(unexpected)}; pass a tree with the keys of `model.params`"
    )


def _clip(paths: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(p) for p in paths[:limit])
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return f"[{shown}{more}]"


def functionalize(module: nn.Module, axes: Mapping[str, Axes] | None = None) -> Model:
    """Turn ``module`` into a :class:`Model`: a pure ``apply`` over a flat params dict.

    Params are keyed by module path and share storage with the module (no copy). Logical axes
    come, first match wins, from ``axes``; then from ``logical_axes`` dicts that modules declare
    (path regexes relative to that module, deepest module first); then defaults for
    ``nn.Linear`` (``("out", "in")``), ``nn.Embedding`` (``("vocab", "embed")``) and norms
    (``("embed",)``); any other param gets ``None`` for every dim (no logical axis).

    Args:
        module: Any ``nn.Module``, e.g. a ``transformers`` model built from a config.
        axes: ``{path regex: logical axis names}``, matched with ``re.search`` against param
            paths; every pattern must match at least one param.

    Returns:
        The :class:`Model`; tied params appear once in ``params`` under their first path and
        ``tied`` maps every other path to it.

    Raises:
        ValueError: A rule's rank differs from its param's, or an ``axes`` pattern matches no
            param.

    Example:
        >>> model = functionalize(torch.nn.Linear(3, 2), axes={r"^weight$": ("mlp", "embed")})
        >>> model.axes
        {'weight': ('mlp', 'embed'), 'bias': ('out',)}
    """
    params: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    canonical_by_id: dict[int, str] = {}
    slots: list[_Slot] = []
    for owner_path, owner in module.named_modules(remove_duplicate=False):
        for name, tensor in owner._parameters.items():
            if tensor is None:
                continue
            key = f"{owner_path}.{name}" if owner_path else name
            canonical = canonical_by_id.setdefault(id(tensor), key)
            if canonical == key:
                params[key] = tensor.detach()
            else:
                tied[key] = canonical
            slots.append(_Slot(key, owner, name, is_param=True))
    buffers: dict[str, torch.Tensor] = {}
    for owner_path, owner in module.named_modules(remove_duplicate=False):
        for name, tensor in owner._buffers.items():
            key = f"{owner_path}.{name}" if owner_path else name
            if tensor is None or key in buffers:
                continue
            buffers[key] = tensor.detach()
            slots.append(_Slot(key, owner, name, is_param=False))
    unique = tuple({(id(s.owner), s.name, s.is_param): s for s in slots}.values())
    block_paths = _block_paths(module)
    blocks = _blocks(block_paths, unique)
    owning = {id(block) for block, _ in blocks}
    homes = tuple(
        (path, module.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2])
        for path, block in block_paths
        if id(block) in owning
    )
    in_blocks = {id(s) for _, block_slots in blocks for s in block_slots}
    root_slots = tuple(s for s in unique if s.is_param and id(s) not in in_blocks)
    model = Model(
        module=module,
        params=params,
        buffers=buffers,
        axes=_resolve_axes(module, params, dict(axes or {})),
        tied=tied,
        _slots=unique,
        _blocks=blocks,
        _block_homes=homes,
        _root_slots=root_slots,
        _buffer_slots=tuple(s for s in unique if not s.is_param),
        _regions=_regions(module, block_paths),
        _root_owners=_root_owners(module, root_slots, tied),
        _position_kwarg=position_kwarg(module),
    )
    for index, (block, _) in enumerate(blocks):
        block.register_forward_pre_hook(
            functools.partial(enter_block, model, index), with_kwargs=True
        )
        block.register_forward_hook(functools.partial(exit_block, model, index))
    for path, child in module.named_modules():
        if not (_is_layer(child) or path in model._regions or path in model._root_owners):
            continue
        child.register_forward_pre_hook(
            functools.partial(enter_module, model, path), with_kwargs=True
        )
        child.register_forward_hook(functools.partial(exit_module, model, path))
    return model


def _block_paths(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of the outermost ``nn.ModuleList``s, with their paths."""
    prefixes: list[tuple[str, nn.Module]] = []
    for path, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and not any(
            path.startswith(p + ".") for p, _ in prefixes
        ):
            prefixes += [
                (f"{path}.{name}" if path else name, block)
                for name, block in child.named_children()
            ]
    return prefixes


def _is_layer(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear | nn.Embedding)


def _regions(
    module: nn.Module, block_paths: list[tuple[str, nn.Module]]
) -> dict[str, tuple[str, ...]]:
    """Tensor-parallel regions, each with the linears inside it: every child of a block, and
    every linear outside blocks."""
    linears = [p for p, m in module.named_modules() if isinstance(m, nn.Linear)]
    regions: dict[str, tuple[str, ...]] = {}
    for block_path, block in block_paths:
        for name, _ in block.named_children():
            child = f"{block_path}.{name}"
            regions[child] = tuple(p for p in linears if p == child or p.startswith(child + "."))
    in_blocks = tuple(p + "." for p, _ in block_paths)
    regions.update({p: (p,) for p in linears if not p.startswith(in_blocks)})
    return regions


def _root_owners(
    module: nn.Module, root_slots: tuple[_Slot, ...], tied: dict[str, str]
) -> dict[str, tuple[str, ...]]:
    """Modules owning params outside blocks, with those params' (canonical) keys."""
    paths = {id(m): p for p, m in module.named_modules()}
    owners: dict[str, list[str]] = {}
    for slot in root_slots:
        owners.setdefault(paths[id(slot.owner)], []).append(tied.get(slot.key, slot.key))
    return {path: tuple(keys) for path, keys in owners.items()}


def _blocks(
    block_paths: list[tuple[str, nn.Module]], slots: tuple[_Slot, ...]
) -> tuple[tuple[nn.Module, tuple[_Slot, ...]], ...]:
    """The blocks that own params, with the param slots under each."""
    blocks = []
    for prefix, block in block_paths:
        owned = tuple(s for s in slots if s.is_param and s.key.startswith(prefix + "."))
        if owned:
            blocks.append((block, owned))
    return tuple(blocks)


def _resolve_axes(
    module: nn.Module, params: dict[str, torch.Tensor], user_rules: dict[str, Axes]
) -> dict[str, Axes]:
    rules: list[tuple[str, str, Axes, str]] = [("", p, a, "axes=") for p, a in user_rules.items()]
    declared = [(path, m) for path, m in module.named_modules() if hasattr(m, "logical_axes")]
    for path, owner in sorted(declared, key=lambda pm: -pm[0].count(".") - bool(pm[0])):
        source = f"{type(owner).__name__}.logical_axes"
        rules += [(path, p, a, source) for p, a in owner.logical_axes.items()]
    owners = {path: m for path, m in module.named_modules()}
    used = set()
    resolved: dict[str, Axes] = {}
    for key, tensor in params.items():
        found = _match_rule(key, rules)
        if found is not None:
            pattern, names, source = found
            used.add((source, pattern))
        else:
            names, source = _default_axes(owners, key, tensor.ndim), "default"
        if len(names) != tensor.ndim:
            raise ValueError(
                f"param {key!r} has shape {tuple(tensor.shape)} but its logical axes {names} "
                f"(from {source}) name {len(names)} dims: give one name per dim"
            )
        resolved[key] = tuple(names)
    unused = [p for p in user_rules if ("axes=", p) not in used]
    if unused:
        raise ValueError(
            f"axes patterns {unused} match no param; param paths look like {_clip(list(params), 4)}"
        )
    return resolved


def _match_rule(key: str, rules: list[tuple[str, str, Axes, str]]) -> tuple[str, Axes, str] | None:
    for prefix, pattern, names, source in rules:
        if prefix and not key.startswith(prefix + "."):
            continue
        relative = key[len(prefix) + 1 :] if prefix else key
        if re.search(pattern, relative):
            return pattern, names, source
    return None


def _default_axes(owners: dict[str, nn.Module], key: str, ndim: int) -> Axes:
    owner_path, _, name = key.rpartition(".")
    owner = owners[owner_path]
    for module_type, param_name, names in _DEFAULT_AXES:
        if isinstance(owner, module_type) and name == param_name:
            return names
    return (None,) * ndim
