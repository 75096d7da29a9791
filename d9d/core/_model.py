"""``functionalize``: an ``nn.Module`` as a pure ``apply(params, ...)`` with logical axes."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import hf
from ..errors import ParamShapeError, ParamTreeMismatchError
from ._apply import apply_in_step, held
from ._context import current
from ._donation import check_not_donated
from ._embedding_ids import embedding_checks
from ._structure import Axes, Structure, structure_of

__all__ = ["Axes", "Model", "functionalize"]

_DEFAULT_AXES: tuple[tuple[type[nn.Module], str, Axes], ...] = (
    (nn.Linear, "weight", ("out", "in")),
    (nn.Linear, "bias", ("out",)),
    (nn.Embedding, "weight", ("vocab", "embed")),
    (nn.LayerNorm, "weight", ("embed",)),
    (nn.LayerNorm, "bias", ("embed",)),
    (nn.RMSNorm, "weight", ("embed",)),
)


@dataclass(frozen=True, eq=False)
class Model:
    """A module seen as a pure function of a flat params dict.

    Attributes:
        module: The wrapped module; ``apply`` swaps tensors in for one call and restores them.
        params: ``{path: tensor}`` of every distinct param (tied aliases appear once).
        buffers: ``{path: tensor}`` of every buffer, passed to each call.
        axes: ``{path: logical axis names}`` per param, one name (or ``None``) per dim.
        tied: ``{alias path: canonical path}`` for params shared between modules.
        structure: The module's slots, blocks and param owners, which transforms read.
        defaults: Keyword arguments ``apply`` passes the forward unless given
            (``use_cache=False`` for a ``transformers`` model: ``d9d.hf.apply_defaults``).

    Example:
        >>> import torch
        >>> model = functionalize(torch.nn.Linear(3, 2))  # a Model
        >>> sorted(model.params), model.axes["weight"]
        (['bias', 'weight'], ('out', 'in'))
        >>> model.apply(model.params, torch.ones(1, 3)).shape
        torch.Size([1, 2])
    """

    module: nn.Module
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    axes: dict[str, Axes]
    tied: dict[str, str]
    structure: Structure = field(repr=False)
    defaults: dict[str, Any] = field(default_factory=dict)

    def apply(self, params: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """Call the module's forward with ``params`` in place of its own tensors.

        Pure: the module's own params and buffers are restored afterwards, and the same inputs
        give the same outputs. Not thread-safe on one module: build a ``Model`` per thread.
        Inside a transformed step the params are DTensors and each is gathered to its compute
        layout when used: a block's params (a child of an ``nn.ModuleList``) when that block
        runs, the others when ``apply`` starts. A param the module built with
        ``requires_grad=False`` is used detached: no grad reaches it (``d9d.value_and_grad``
        gives it zeros), as in torch.

        Args:
            params: ``{path: tensor}`` with exactly the paths of ``self.params``.
            *args: Positional inputs of ``module.forward``.
            **kwargs: Keyword inputs of ``module.forward``, over :attr:`defaults`.

        Returns:
            Whatever ``module.forward`` returns (a ``transformers`` model's output object: take
            its ``.logits``).

        Raises:
            ParamTreeMismatchError: ``params`` misses paths of the model or has extra ones.
            ParamShapeError: A param's (global) shape is not the model's.
            DonatedTreeError: (called eagerly) a param was donated to an earlier ``d9d.jit``
                call, so its buffer holds that call's new values.
            IndexRangeError: An ``nn.Embedding`` gets ids outside ``[0, num_embeddings)``
                (checked before its lookup; the error names the ``d9d.value_and_grad``
                input they come from, like ``batch['tokens']``).
            ValueError: Eagerly, the forward wrote one of the module's buffers in place
                (BatchNorm's running statistics in training mode): named, with what to do.

        Example:
            >>> model = functionalize(torch.nn.Linear(3, 2))
            >>> model.apply(model.params, torch.ones(1, 3)).shape
            torch.Size([1, 2])
        """
        kwargs = {**self.defaults, **kwargs}
        versions = _versions(self.buffers)
        step = current()
        if step is None:
            if not torch.compiler.is_compiling():  # a jitted call checked its inputs already
                check_not_donated(params, name="params")
            self.check_params(params)
            out = self._apply_alone(params, args, kwargs)
        else:  # the params may be local shards here: the plan holds their global shapes
            plan = step.plan
            self.check_params(
                {p: plan.entries.get(p, leaf) for p, leaf in params.items()},
                subset=len(plan.held) < len(plan.entries),
            )
            with embedding_checks(self.structure.modules):
                out = apply_in_step(step, self.structure, params, self.buffers, args, kwargs)
        _check_buffers_kept(self.buffers, versions)
        return out

    def _apply_alone(self, params: Mapping[str, torch.Tensor], args: Any, kwargs: Any) -> Any:
        """The forward outside a step: the module's slots hold ``params`` for the call."""
        structure = self.structure
        saved = []
        for slot in structure.slots:
            if slot.is_param:
                key = structure.canonical(slot.key)
                saved.append(slot.swap(held(params[key], key, structure)))
            else:
                saved.append(slot.swap(self.buffers[slot.key]))
        try:
            with embedding_checks(self.structure.modules):
                return self.module(*args, **kwargs)
        finally:
            for slot, old in zip(structure.slots, saved, strict=True):
                slot.swap(old)

    def __deepcopy__(self, memo: dict[int, Any]) -> Model:
        """A model of a deep copy of the module, with the same axes and defaults. The
        structure is read again from the copy: it holds the module's own objects (its slots'
        owners, its modules by ``id``), which a field-by-field copy would leave pointing at
        the original's.

        Example:
            >>> import copy
            >>> model = functionalize(torch.nn.Linear(3, 2))
            >>> twin = copy.deepcopy(model)
            >>> twin.params["weight"] is model.params["weight"], twin.axes == model.axes
            (False, True)
        """
        module = copy.deepcopy(self.module, memo)
        structure, params, buffers = structure_of(module)
        return Model(
            module=module,
            params=params,
            buffers=buffers,
            axes=dict(self.axes),
            tied=structure.tied,
            structure=structure,
            defaults=copy.deepcopy(self.defaults, memo),
        )

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
    (path regexes relative to that module, deepest module first); then, for a ``transformers``
    model, from ``d9d.hf.axes_for(module)`` (its family's rules and its norms); then defaults for
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
    structure, params, buffers = structure_of(module)
    return Model(
        module=module,
        params=params,
        buffers=buffers,
        axes=_resolve_axes(module, params, dict(axes or {})),
        tied=structure.tied,
        structure=structure,
        defaults=hf.apply_defaults(module),
    )


def _versions(buffers: Mapping[str, torch.Tensor]) -> dict[str, int] | None:
    """Each buffer's version counter (bumped by every in-place write), or None under
    ``torch.compile``, which traces no version counters."""
    if torch.compiler.is_compiling():
        return None
    return {p: b._version for p, b in buffers.items() if not b.is_inference()}


def _check_buffers_kept(
    buffers: Mapping[str, torch.Tensor], versions: dict[str, int] | None
) -> None:
    """Raise if the forward wrote a buffer in place: state that is neither a param nor an
    input, which no step returns, no rank shares and no checkpoint saves."""
    if versions is None:
        return
    written = [p for p, version in versions.items() if buffers[p]._version != version]
    if written:
        # Named by their modules too: aten's batch_norm writes running_mean and running_var
        # without bumping their versions; its num_batches_tracked counts the call.
        owners = sorted({p.rpartition(".")[0] or "the root module" for p in written})
        raise ValueError(
            f"the module's forward wrote its buffers {written} in place (in {owners}: "
            "BatchNorm's running statistics in training mode, a cache): apply is a pure "
            "function of params and "
            "inputs, and such state would differ between ranks and be lost by checkpoints. "
            "Put those modules in eval mode, build them without running state "
            "(track_running_stats=False), or use a norm without it (LayerNorm, RMSNorm)"
        )


def _resolve_axes(
    module: nn.Module, params: dict[str, torch.Tensor], user_rules: dict[str, Axes]
) -> dict[str, Axes]:
    rules: list[tuple[str, str, Axes, str]] = [("", p, a, "axes=") for p, a in user_rules.items()]
    declared = [(path, m) for path, m in module.named_modules() if hasattr(m, "logical_axes")]
    for path, owner in sorted(declared, key=lambda pm: -pm[0].count(".") - bool(pm[0])):
        source = f"{type(owner).__name__}.logical_axes"
        rules += [(path, p, a, source) for p, a in owner.logical_axes.items()]
    family = f"d9d.hf rules of {hf.family_of(module)!r}"
    rules += [("", p, a, family) for p, a in hf.axes_for(module).items()]
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
