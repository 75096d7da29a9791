"""Random draws in training (dropout, router jitter) are refused under ``tensor_parallel``.

Each rank draws from its own generator on its local tensors. On a replicated activation
(the output of a row-parallel linear after its all-reduce) the ranks' masks agree only
while their generators do: seeded per rank (``torch.manual_seed(seed + rank)``), or with
ranks that are threads sharing one generator, the replicas of one tensor diverge and every
grad is wrong with no error (GPT-2, ``tp=2``, dropout 0.1, fork ranks seeded per rank:
block 1's input differs by 0.10 between the ranks, grads by 103% of their largest entry;
``docs/tensor_parallel.md``). On a sharded activation (heads, a sequence-parallel slice)
ranks seeded alike draw the same mask on every shard. d9d keeps no per-region generator,
so it refuses a model that would draw, naming the module or config field to zero.
"""

from __future__ import annotations

import numbers

from torch import nn

from ...core._random_draws import DRAWN_ATTRIBUTES
from ...core._structure import Structure
from ...errors import PlanError
from ._layout import ActivationLayout

__all__ = ["check_random_draws"]

# Config fields (transformers' names) of a probability or noise drawn in training.
_DRAWN_FIELDS = ("dropout", "pdrop", "jitter")


def check_random_draws(structure: Structure, layout: ActivationLayout) -> None:
    """Raise when a module in training mode would draw random numbers: an ``nn.Dropout``
    (or another ``_DropoutNd``) with ``p > 0``, or a float attribute of a functional
    dropout or a router's jitter above 0 (transformers' attentions keep
    ``attention_dropout``, Mixtral-style routers ``jitter_noise``). Reads only the modules
    of ``structure.drawing`` (found once per structure), their flag and rate as they are
    now. The message names the module and the config fields of the same value, the likely
    source."""
    for path in structure.drawing:
        module = structure.modules[path]
        if not module.training:
            continue
        name = path or "the model"
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            raise PlanError(
                f"module {name!r} ({type(module).__name__}, p={module.p}) drops out in "
                f"training{_source(structure.module, module.p)}; {_fix(layout)}"
            )
        for attribute in DRAWN_ATTRIBUTES:
            value = module.__dict__.get(attribute)
            if _positive(value):
                raise PlanError(
                    f"module {name!r} has {attribute}={value}, drawn in training"
                    f"{_source(structure.module, value)}; {_fix(layout)}"
                )


def _fix(layout: ActivationLayout) -> str:
    """Why the draw is refused under ``layout`` and what to do instead."""
    return (
        f"tensor_parallel's {layout.axis!r} ranks would draw unequal masks on replicated "
        "activations and the same mask on every shard of sharded ones; set it to 0 (or "
        "call module.eval() to train without dropout), or train without tensor_parallel "
        "(docs/tensor_parallel.md, 'Random draws')"
    )


def _positive(value: object) -> bool:
    """Whether ``value`` is a real number above 0 (not a bool); an ``int`` or ``float`` is
    told before the ABC's check (about 1 us each)."""
    if value is None or isinstance(value, bool):
        return False
    return isinstance(value, (int, float, numbers.Real)) and value > 0


def _source(root: nn.Module, value: float) -> str:
    """`` (config fields equal to it: a, b)``: the root's config fields of a dropout or a
    jitter equal to ``value``, or nothing."""
    config = getattr(root, "config", None)
    found = [
        name
        for name, field in sorted(getattr(config, "__dict__", {}).items())
        if any(part in name for part in _DRAWN_FIELDS) and _positive(field) and field == value
    ]
    return f" (config fields equal to it: {', '.join(found)})" if found else ""
