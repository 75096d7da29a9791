"""Which of a model's linears compute in fp8, and why the others do not.

A linear (an ``nn.Linear`` submodule, d9d's or a Hugging Face model's) computes in fp8 when
its path matches ``include`` (default: every linear), does not match ``exclude``, and none
of the default exclusions holds:

- the output head, a linear outside the model's blocks (in a model with blocks): the logits feed the loss directly
  and carry the whole vocabulary (torchao and torchtitan keep it in high precision too);
- a router, a linear named ``router`` or ``gate`` (a Hugging Face MoE's router: its logits
  decide where tokens go, and a few ULPs move them; Llama's ``gate_proj`` is not one);
- a linear whose ``in_features`` or ``out_features``, as each rank computes it (its
  ``tensor_parallel`` shard), is not a multiple of 16 (``torch._scaled_mm`` takes its K and N
  in multiples of 16);
- a linear (or routed experts) computed in float64, which the fp8 GEMMs do not write;
- a linear of an ``nn.Linear`` subclass whose ``forward`` is not ``nn.Linear.forward``: the
  interception computes ``F.linear(x, weight, bias)`` in its place and would drop whatever
  else that forward does.

The embedding is an ``nn.Embedding``, no linear: it is never intercepted. ``d9d.moe``'s
routed experts (an ``Experts`` module: stacked ``[E, K, N]`` weights, grouped GEMMs) compute
in fp8 when the experts module's path matches ``include`` and not ``exclude``; all three of
its weights share its choice. They have no dims rule: their three GEMMs (``fp8_grouped_gemm``
and, for the weight grad, ``fp8_grouped_gemm_k``) take any shape.
``d9d.moe``'s router is no ``nn.Linear`` and is never intercepted; its weight gets a choice
of high precision, so the plan says why. So do the routed experts of any other module (a
Hugging Face experts module such as ``Qwen3MoeExperts``: stacked params whose logical axes
start with ``experts`` and name ``expert_mlp``), which compute in their own kernels.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from ...core._param_plan import ParamPlan
from ...core._plan import Plan
from ...core._structure import Structure
from ...errors import PlanError
from ...kernels._fp8_gemm import OUT_DTYPES
from ...moe import Experts, MoE
from ..expert_parallel import is_expert_weight

__all__ = ["Choice", "choose", "compiled_pattern"]

MULTIPLE = 16
_ROUTER_NAMES = ("router", "gate")
_ROUTER = "a router (its logits choose the experts): never in fp8"
_NEVER = ("router", "other_experts")  # kinds no pattern can bring into fp8


@dataclass(frozen=True)
class Choice:
    """One linear's (or one routed expert weight's) fate under ``fp8``.

    Attributes:
        path: The linear's (the experts') module path.
        weight: Its weight's param path (the canonical one, when tied).
        recipe: The recipe it computes its matmuls in, or None: high precision.
        why: Why not, when ``recipe`` is None.
        kind: ``"linear"`` (an ``nn.Linear``), ``"experts"`` (a ``d9d.moe`` experts
            module's stacked weight, in its grouped GEMMs), ``"router"`` (a ``d9d.moe``
            router's weight) or ``"other_experts"`` (a param of another module holding
            routed experts, a Hugging Face one): the last two always high precision.
    """

    column: ClassVar[str] = "fp8"  # the plan table's column this annotation fills
    path: str
    weight: str
    recipe: str | None
    why: str = ""
    kind: str = "linear"

    def cell(self) -> str:
        """Its cell in the plan's table: the recipe, or ``-``."""
        return self.recipe or "-"


def compiled_pattern(name: str, pattern: str | None) -> re.Pattern[str] | None:
    """``pattern`` compiled, or a ``PlanError`` naming the option and the regex error."""
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as error:
        raise PlanError(f"fp8({name}={pattern!r}) is not a regular expression: {error}") from None


def choose(
    structure: Structure,
    plan: Plan,
    recipe: str,
    include: re.Pattern[str] | None,
    exclude: re.Pattern[str] | None,
) -> tuple[Choice, ...]:
    """The choice for every linear and every routed expert weight of ``structure`` under
    ``plan``, in module order.

    Raises:
        PlanError: ``include`` or ``exclude`` matches no linear's or experts module's path.
    """
    blocks = tuple(b.path + "." for b in structure.blocks)
    choices = []
    for path, module in structure.modules.items():
        if isinstance(module, MoE):
            weight = structure.canonical(_child(path, "router.weight"))
            choices.append(Choice(f"{path}.router", weight, None, _ROUTER, "router"))
        if isinstance(module, Experts):
            why = _not_matched(path, include, exclude)
            for name, _ in module.named_parameters(recurse=False):
                weight = structure.canonical(_child(path, name))
                why_not = why or _dtype_refused(plan.entries[weight])
                choices.append(
                    Choice(path, weight, None if why_not else recipe, why_not, "experts")
                )
            continue
        if not isinstance(module, nn.Linear):
            choices += _other_experts(structure, plan, path, module)
            continue
        weight = structure.canonical(_child(path, "weight"))
        entry = plan.entries[weight]
        out_features, in_features = entry.local_shape(plan.mesh, entry.compute)
        dims = {"in_features": in_features, "out_features": out_features}
        why = _why_not(path, dims, blocks, include, exclude) or _own_forward(module)
        why = why or _dtype_refused(entry)
        choices.append(Choice(path, weight, None if why else recipe, why))
    for name, pattern in (("include", include), ("exclude", exclude)):
        chosen = [c for c in choices if c.kind not in _NEVER]
        if pattern is not None and not any(pattern.search(c.path) for c in chosen):
            linears = list(dict.fromkeys(c.path for c in chosen))
            never = {c.path: c.why for c in choices if c.kind in _NEVER and pattern.search(c.path)}
            also = "".join(f"; it matches {path}, {why}" for path, why in list(never.items())[:2])
            raise PlanError(
                f"fp8({name}={pattern.pattern!r}) matches no linear (nor routed experts module) "
                f"of the model; its linears and experts are "
                f"{linears[:6]}{' ...' if len(linears) > 6 else ''}{also}: fix the pattern"
            )
    return tuple(choices)


def _other_experts(structure: Structure, plan: Plan, path: str, module: nn.Module) -> list[Choice]:
    """High-precision choices for the own params of ``module`` (at ``path``) if it holds
    routed experts (a param whose logical axes start with ``experts`` and name
    ``expert_mlp``) and is no ``d9d.moe`` experts module: ``fp8`` computes none of them."""
    names = (
        structure.canonical(_child(path, n)) for n, _ in module.named_parameters(recurse=False)
    )
    weights = [w for w in names if w in plan.entries]
    if not any(is_expert_weight(plan.entries[w]) for w in weights):
        return []
    why = (
        f"routed experts of a {type(module).__name__}, which computes them in its own kernels: "
        "fp8 intercepts nn.Linear and d9d.moe's experts only (d9d.checkpoint.import_hf_moe "
        "converts a Qwen3-MoE to d9d.models.MoE)"
    )
    return [Choice(path, weight, None, why, "other_experts") for weight in weights]


def _dtype_refused(entry: ParamPlan) -> str:
    """Why a weight computed in a dtype the fp8 GEMMs cannot write (float64) stays in high
    precision ('' for float32, bfloat16 and float16): the output has the input's dtype."""
    dtype = entry.compute_dtype or entry.dtype
    if dtype in OUT_DTYPES:
        return ""
    names = [str(d).removeprefix("torch.") for d in OUT_DTYPES]
    return f"computed in {str(dtype).removeprefix('torch.')}: the fp8 GEMMs write {names} only"


def _own_forward(module: nn.Linear) -> str:
    """Why a linear whose class has a forward of its own stays in high precision ('' when
    its forward is ``nn.Linear``'s): the interception stands in for ``F.linear(x, weight,
    bias)`` and would drop what that forward does beside it (a scale, an added term)."""
    if type(module).forward is nn.Linear.forward:
        return ""
    return (
        f"an nn.Linear subclass ({type(module).__name__}) with a forward of its own, which "
        "fp8 would replace by nn.Linear's F.linear"
    )


def _child(path: str, name: str) -> str:
    """The path of ``name`` under the module at ``path`` (``""``: the root module)."""
    return f"{path}.{name}" if path else name


def _why_not(
    path: str,
    dims: dict[str, int],
    blocks: tuple[str, ...],
    include: re.Pattern[str] | None,
    exclude: re.Pattern[str] | None,
) -> str:
    """Why the linear at ``path`` stays in high precision ('' when it computes in fp8)."""
    why = _not_matched(path, include, exclude)
    if why:
        return why
    if not path:
        return "the model's root module, for which no runtime can stand in: wrap it in another"
    if blocks and not path.startswith(blocks):
        return "the output head (a linear outside the blocks)"
    if path.rpartition(".")[2] in _ROUTER_NAMES:
        return "a router (its logits choose the experts)"
    odd = {name: size for name, size in dims.items() if size % MULTIPLE}
    if odd:
        return (
            f"dims as computed on a rank not multiples of {MULTIPLE} ({odd}), which "
            "torch._scaled_mm refuses"
        )
    return ""


def _not_matched(
    path: str, include: re.Pattern[str] | None, exclude: re.Pattern[str] | None
) -> str:
    """Why ``include``/``exclude`` leave the module at ``path`` out ('' when they keep it)."""
    if include is not None and not include.search(path):
        return f"not matched by include={include.pattern!r}"
    if exclude is not None and exclude.search(path):
        return f"excluded by exclude={exclude.pattern!r}"
    return ""
