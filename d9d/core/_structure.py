"""What ``functionalize`` learns about a module: its tensor slots, blocks and owners.

Transforms read a model through this structure (never through the module's internals): the
slots that hold each param and buffer, the blocks (children of the outermost
``nn.ModuleList``s) with the slots under each, and the modules owning params outside blocks.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import hf
from ._grad_mode import computes_without_grad
from ._random_draws import may_draw

__all__ = ["Axes", "Block", "Slot", "Structure", "position_wise_paths", "structure_of"]

Axes = tuple[str | None, ...]
"""Logical axis names of one param, one per tensor dim; ``None`` names no axis."""


@dataclass(frozen=True, eq=False)
class Slot:
    """Where one tensor lives in the module: ``owner._parameters[name]`` or ``_buffers``.

    Attributes:
        key: The tensor's path (a tied alias keeps its own path; see ``Structure.tied``).
        owner: The module holding it.
        name: Its name in the owner.
        is_param: A param (else a buffer).
    """

    key: str
    owner: nn.Module
    name: str
    is_param: bool

    def store(self) -> dict[str, Any]:
        """The owner's dict that holds this tensor."""
        return self.owner._parameters if self.is_param else self.owner._buffers

    def swap(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """Put ``tensor`` in the slot; returns what was there."""
        store = self.store()
        old = store[self.name]
        store[self.name] = tensor
        return old


@dataclass(frozen=True, eq=False)
class Block:
    """A child of the model's outermost ``nn.ModuleList`` that owns params.

    Attributes:
        index: Its position among the blocks that own params.
        path: Its module path, e.g. ``layers.3``.
        module: The block.
        slots: The param slots under it.
    """

    index: int
    path: str
    module: nn.Module
    slots: tuple[Slot, ...]


@dataclass(frozen=True, eq=False)
class Structure:
    """The tensor slots, blocks and param owners of a module.

    Attributes:
        module: The module.
        tied: ``{alias path: canonical path}`` for params shared between modules.
        slots: Every distinct param and buffer slot.
        blocks: The blocks owning params, in order.
        root_slots: Param slots outside every block.
        buffer_slots: Buffer slots.
        root_owners: ``{module path: canonical param paths}`` of the modules owning params
            outside blocks, in registration order.
        modules: ``{path: module}`` of every submodule, as registered (runtimes look modules
            up here: during a call a parent may hold a stand-in).
        paths: ``{id(module): path}``, the inverse of ``modules``.
        positions_keyword: The keyword under which ``module.forward`` takes token positions
            (``positions`` or ``position_ids``), if any.
        positional_inputs: The names of ``module.forward``'s inputs that may be passed by
            position, in order (read here, once, not in a traced step).
        position_wise: Paths of the modules declared to compute each position on its own
            (see :func:`position_wise_paths`), outermost first.
        without_grad: Paths of the modules whose forward computes without grad
            (``computes_without_grad``: read here, once, and not in a traced step, where
            reading a decorator's closure cells would break Dynamo's view of them).
        frozen: Canonical paths of the params built with ``requires_grad=False``, which get
            no grad through ``Model.apply`` (a zero one from ``d9d.value_and_grad``).
        drawing: Paths of the modules that may draw random numbers in training (a dropout
            module, or a dropout's or jitter's rate attribute: ``may_draw``), whatever their
            rate now: transforms read the rates and training flags of these alone at each step.
    """

    module: nn.Module
    tied: dict[str, str]
    slots: tuple[Slot, ...]
    blocks: tuple[Block, ...]
    root_slots: tuple[Slot, ...]
    buffer_slots: tuple[Slot, ...]
    root_owners: dict[str, tuple[str, ...]]
    modules: dict[str, nn.Module]
    paths: dict[int, str]
    positions_keyword: str | None
    positional_inputs: tuple[str, ...] = ()
    position_wise: tuple[str, ...] = ()
    without_grad: tuple[str, ...] = ()
    frozen: frozenset[str] = frozenset()
    drawing: tuple[str, ...] = ()

    def given_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """``{name: value}`` of a call of the forward, its positional inputs by name."""
        return {**dict(zip(self.positional_inputs, args, strict=False)), **kwargs}

    def canonical(self, key: str) -> str:
        """The path under which the param at ``key`` is stored (its own unless tied)."""
        return self.tied.get(key, key)

    def owner_path(self, slot: Slot) -> str:
        """The module path of the slot's owner."""
        return self.paths[id(slot.owner)]


def structure_of(module: nn.Module) -> tuple[Structure, dict[str, torch.Tensor], dict[str, Any]]:
    """``(structure, params, buffers)`` of ``module``: its distinct params (tied aliases
    once, under their first path) and its buffers, detached, sharing storage."""
    params: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    canonical_by_id: dict[int, str] = {}
    slots: list[Slot] = []
    frozen: set[str] = set()
    for owner_path, owner in module.named_modules(remove_duplicate=False):
        for name, tensor in owner._parameters.items():
            if tensor is None:
                continue
            key = f"{owner_path}.{name}" if owner_path else name
            canonical = canonical_by_id.setdefault(id(tensor), key)
            if canonical == key:
                params[key] = tensor.detach()
                if not tensor.requires_grad:
                    frozen.add(key)
            else:
                tied[key] = canonical
            slots.append(Slot(key, owner, name, is_param=True))
    buffers: dict[str, torch.Tensor] = {}
    for owner_path, owner in module.named_modules(remove_duplicate=False):
        for name, tensor in owner._buffers.items():
            key = f"{owner_path}.{name}" if owner_path else name
            if tensor is None or key in buffers:
                continue
            buffers[key] = tensor.detach()
            slots.append(Slot(key, owner, name, is_param=False))
    unique = tuple({_identity(s): s for s in slots}.values())
    # Every path of a slot: a module shared by several blocks (or by a block and the code
    # around the blocks) is used, and gathered, in each of them.
    aliases: dict[tuple[int, str, bool], list[str]] = {}
    for slot in slots:
        aliases.setdefault(_identity(slot), []).append(slot.key)
    blocks = _blocks(module, unique, aliases)
    prefixes = tuple(block.path + "." for block in blocks)
    root_slots = tuple(
        s
        for s in unique
        if s.is_param and any(not k.startswith(prefixes) for k in aliases[_identity(s)])
    )
    modules = dict(module.named_modules())
    paths = {id(m): p for p, m in modules.items()}
    owners: dict[str, list[str]] = {}
    for slot in root_slots:
        owners.setdefault(paths[id(slot.owner)], []).append(tied.get(slot.key, slot.key))
    inputs = inspect.signature(module.forward).parameters
    structure = Structure(
        module=module,
        tied=tied,
        slots=unique,
        blocks=blocks,
        root_slots=root_slots,
        buffer_slots=tuple(s for s in unique if not s.is_param),
        root_owners={path: tuple(keys) for path, keys in owners.items()},
        modules=modules,
        paths=paths,
        positions_keyword=next(
            (n for n in ("positions", "position_ids") if n in inputs),
            None,
        ),
        positional_inputs=tuple(
            name
            for name, p in inputs.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ),
        position_wise=position_wise_paths(module),
        without_grad=tuple(p for p, m in modules.items() if computes_without_grad(m)),
        frozen=frozenset(frozen),
        drawing=tuple(p for p, m in modules.items() if may_draw(m)),
    )
    return structure, params, buffers


def position_wise_paths(module: nn.Module) -> tuple[str, ...]:
    """Paths of the modules under ``module`` declared *position-wise*: each position of their
    output depends on that position of their input only (an MLP, a dropless MoE layer; not
    attention), apart from statistics the module sums over ranks itself (through
    ``d9d.core._context``). A module declares it with an attribute ``position_wise = True`` (a
    class attribute, or one set per instance, e.g. ``d9d.moe.MoE`` when it drops no
    token); a Hugging Face family's modules get it from ``d9d.hf``. Transforms may then run
    such a module on part of each sequence (``tensor_parallel``'s sequence parallelism)."""
    declared = {p for p, m in module.named_modules() if getattr(m, "position_wise", False) is True}
    declared.update(hf.position_wise_for(module))
    return tuple(p for p, _ in module.named_modules() if p in declared)


def block_paths(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of the ``nn.ModuleList``s a Hugging Face model's pipeline plan names
    (``d9d.hf.block_lists_for``), else of the outermost ``nn.ModuleList``s, with their paths."""
    planned = hf.block_lists_for(module)
    if planned:
        return [
            (f"{path}.{name}", block)
            for path in planned
            for name, block in module.get_submodule(path).named_children()
        ]
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


def _identity(slot: Slot) -> tuple[int, str, bool]:
    """What one slot is, under every path that reaches it."""
    return id(slot.owner), slot.name, slot.is_param


def _blocks(
    module: nn.Module, slots: tuple[Slot, ...], aliases: dict[tuple[int, str, bool], list[str]]
) -> tuple[Block, ...]:
    """The blocks that own params, with the param slots under each (under any of a slot's
    paths: a module shared by two blocks has its slots in both)."""
    blocks: list[Block] = []
    for prefix, block in block_paths(module):
        owned = tuple(
            s
            for s in slots
            if s.is_param and any(k.startswith(prefix + ".") for k in aliases[_identity(s)])
        )
        if owned:
            blocks.append(Block(len(blocks), prefix, block, owned))
    return tuple(blocks)
