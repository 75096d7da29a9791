"""``fp8``: the matched linears compute their three matmuls in fp8 with dynamic scaling;
params, their grads and the optimizer state keep their dtype (only compute changes)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from torch.distributed.device_mesh import DeviceMesh

from ...core._param_plan import ParamPlan
from ...core._phase import Phase
from ...core._plan import Plan
from ...core._transform import Transform
from ...errors import PlanError
from ._linear import GRAD_DTYPES
from ._runtime import Fp8Runtime
from ._select import Choice, choose, compiled_pattern

if TYPE_CHECKING:
    from ...core._model import Model

__all__ = ["Fp8", "fp8"]

_EXPERTS = (
    "fp8: stays in high precision: fp8 of d9d.moe's routed experts (their grouped GEMMs) is "
    "not built (issue 28)"
)


@dataclass(frozen=True)
class Fp8(Transform):
    """The ``fp8`` transform; build it with :func:`fp8`."""

    name: ClassVar[str] = "fp8"
    phase: ClassVar[Phase] = Phase.COMPUTE_FORM
    mesh: DeviceMesh | None = None
    recipe: str = "tensorwise"
    include: str | None = None
    exclude: str | None = None

    def __post_init__(self) -> None:
        if self.recipe not in GRAD_DTYPES:
            raise PlanError(
                f"fp8(recipe={self.recipe!r}) is not a recipe; use one of {list(GRAD_DTYPES)}"
            )
        compiled_pattern("include", self.include)
        compiled_pattern("exclude", self.exclude)

    def __str__(self) -> str:
        return f"fp8(recipe={self.recipe!r})"

    def claimed_axes(self) -> tuple[str, ...]:
        return ()

    def rewrite(self, entry: ParamPlan) -> ParamPlan:
        return entry

    def choices(self, plan: Plan, model: Model | None) -> tuple[Choice, ...]:
        """The fate of each of ``model``'s linears under this transform and ``plan``."""
        if model is None:
            raise PlanError(
                f"{self} intercepts the model's linears and needs the model: call "
                "step.place(params, opt_state, model=model)"
            )
        include = compiled_pattern("include", self.include)
        exclude = compiled_pattern("exclude", self.exclude)
        return choose(model.structure, plan, self.recipe, include, exclude)

    def lay_out(self, plan: Plan, model: Model | None) -> Plan:
        entries = dict(plan.entries)
        for choice in self.choices(plan, model):
            entry = entries[choice.weight]
            if choice.recipe is None:
                reason = f"fp8: {choice.path} stays in high precision: {choice.why}"
            else:
                grads = str(GRAD_DTYPES[self.recipe]).removeprefix("torch.")
                reason = (
                    f"{self}: {choice.path} computes its output, input grad and weight grad "
                    f"in fp8 (float8_e4m3fn activations and weights, {grads} grads, dynamic "
                    "scales); the param, its grad and its optimizer state keep their dtype"
                )
            entries[choice.weight] = replace(
                entry.annotate(choice), reasons=(*entry.reasons, reason)
            )
        for path, entry in entries.items():
            if _is_expert_weight(entry):
                entries[path] = replace(entry, reasons=(*entry.reasons, _EXPERTS))
        return replace(plan, entries=entries)

    def runtime(self, plan: Plan, model: Model | None) -> Fp8Runtime:
        paths = tuple(c.path for c in self.choices(plan, model) if c.recipe is not None)
        return Fp8Runtime(paths, self.recipe)


def _is_expert_weight(entry: ParamPlan) -> bool:
    """A stacked routed-expert weight (``d9d.moe``): logical axes ``("experts", ...)`` naming
    an ``expert_mlp`` dim."""
    axes = entry.axes
    return axes is not None and len(axes) > 1 and axes[0] == "experts" and "expert_mlp" in axes


def fp8(
    mesh: DeviceMesh | None = None,
    recipe: str = "tensorwise",
    *,
    include: str | None = None,
    exclude: str | None = None,
) -> Fp8:
    """Compute the matched linears' matmuls in fp8, with dynamic scaling.

    Each chosen ``nn.Linear`` (of a d9d model or a Hugging Face one) computes its output,
    its input grad and its weight grad with ``d9d.kernels.fp8_quantize`` and ``fp8_gemm``:
    activations and weights in float8_e4m3fn, grads in float8_e5m2 (``"tensorwise"``,
    ``"rowwise"``) or float8_e4m3fn (``"blockwise"``, as DeepSeek-V3), each operand scaled
    by the amax of this call's tensor (the whole matrix, each row along the contraction, or
    1x128 tiles and 128x128 weight blocks). The bias is added in high precision and the
    output has the input's dtype. Params, their grads and the optimizer state keep their
    dtype. By default every linear computes in fp8 but the output head (a linear outside the
    blocks), routers (linears named ``router`` or ``gate``) and linears with a dim that is
    not a multiple of 16; ``step.plan`` has an ``fp8`` column and ``plan.explain(path)``
    says why a linear does not. ``d9d.moe``'s routed experts stay in high precision (not
    built), which the plan says. Composes with ``shard_params``, ``tensor_parallel`` (each
    rank scales its shard), ``remat`` and ``d9d.jit`` (``docs/fp8.md``).

    Args:
        mesh: The mesh, when no other transform of the step gives it (as for ``remat``).
        recipe: ``"tensorwise"`` (default), ``"rowwise"`` or ``"blockwise"``.
        include: A regex: only linears whose module path it matches (``re.search``).
        exclude: A regex: linears whose module path it matches stay in high precision.

    Returns:
        The transform: decorate a step with it.

    Raises:
        PlanError: An unknown recipe or a pattern that is no regex; when placed, a pattern
            that matches no linear, or no model given to ``place``.

    Example:
        >>> import d9d, torch
        >>> from d9d.models import Llama, LlamaConfig
        >>> model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=1)))
        >>> loss = d9d.value_and_grad(lambda p, t: model.apply(p, t).float().mean())
        >>> step = fp8(recipe="rowwise")(lambda p, s, t: (p, s, loss(p, t)[0]))
        >>> params, _ = step.place(model.params, (), model=model)
        >>> step.plan["layers.0.attn.wq.weight"].annotations[-1].cell()
        'rowwise'
        >>> step(params, (), torch.zeros(2, 8, dtype=torch.long))[2].shape
        torch.Size([])
    """
    return Fp8(mesh, recipe, include, exclude)
