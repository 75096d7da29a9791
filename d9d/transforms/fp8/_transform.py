"""``fp8``: the matched linears compute their three matmuls in fp8 with dynamic scaling;
params, their grads and the optimizer state keep their dtype (only compute changes)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from torch.distributed.device_mesh import DeviceMesh

from ...core._gather import coalescible
from ...core._param_plan import ParamPlan
from ...core._phase import Phase
from ...core._plan import Plan
from ...core._transform import Transform
from ...errors import PlanError
from ._gather import Fp8Gather
from ._linear import GRAD_DTYPES
from ._runtime import Fp8Runtime
from ._select import Choice, choose, compiled_pattern

if TYPE_CHECKING:
    from ...core._model import Model

__all__ = ["Fp8", "fp8"]


@dataclass(frozen=True)
class Fp8(Transform):
    """The ``fp8`` transform; build it with :func:`fp8`."""

    name: ClassVar[str] = "fp8"
    phase: ClassVar[Phase] = Phase.COMPUTE_FORM
    mesh: DeviceMesh | None = None
    recipe: str = "tensorwise"
    include: str | None = None
    exclude: str | None = None
    gather_in_fp8: bool = False

    def __post_init__(self) -> None:
        if self.recipe not in GRAD_DTYPES:
            raise PlanError(
                f"fp8(recipe={self.recipe!r}) is not a recipe; use one of {list(GRAD_DTYPES)}"
            )
        if not isinstance(self.gather_in_fp8, bool):
            raise PlanError(f"fp8 needs gather_in_fp8=True or False, got {self.gather_in_fp8=}")
        if self.gather_in_fp8 and self.recipe != "tensorwise":
            raise PlanError(
                f"fp8(recipe={self.recipe!r}, gather_in_fp8=True): the fp8 all-gather is built "
                "for tensorwise only (rowwise quantizes a weight along K in the forward and "
                "along N in the input grad, two copies; blockwise's 128x128 blocks straddle "
                "the shards); use recipe='tensorwise' or drop gather_in_fp8"
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
        gathered = 0
        # A weight tied to another module's param (an embedding) is used by more than the
        # fp8 linear: it is gathered as the others take it.
        tied = set(model.structure.tied.values()) if model is not None else set()
        for choice in self.choices(plan, model):
            entry = entries[choice.weight]
            reasons = (*entry.reasons, self._reason(choice))
            if self._gathers_in_fp8(choice, entry) and choice.weight not in tied:
                stacked = choice.kind == "experts"
                codec = Fp8Gather(entry.compute_dtype or entry.dtype, stacked)
                entry, gathered = replace(entry, codec=codec), gathered + 1
                scales = "a scale per expert" if stacked else "its scale"
                reasons = (*reasons, f"{self}: all-gathered as float8_e4m3fn data + {scales}")
            entries[choice.weight] = replace(entry.annotate(choice), reasons=reasons)
        if self.gather_in_fp8:
            self._check_gathered(plan, gathered)
        return replace(plan, entries=entries)

    def _gathers_in_fp8(self, choice: Choice, entry: ParamPlan) -> bool:
        """Whether ``choice``'s weight is all-gathered as fp8 data and scale: a linear's or
        routed experts' weight in fp8 whose plan gathers it over one mesh axis
        (``shard_params``' ZeRO-3)."""
        return (
            self.gather_in_fp8
            and choice.kind in ("linear", "experts")
            and choice.recipe is not None
            and coalescible(entry) is not None
        )

    def _check_gathered(self, plan: Plan, gathered: int) -> None:
        """Refuse ``gather_in_fp8`` where it gathers nothing."""
        if not gathered:
            raise PlanError(
                "fp8(gather_in_fp8=True) found no fp8 linear (nor routed experts) whose weight "
                "is all-gathered: it "
                "needs shard_params(mesh, axis='fsdp') (ZeRO-3, shard='params') in the step; "
                "drop gather_in_fp8 or add shard_params"
            )

    def _reason(self, choice: Choice) -> str:
        """What ``explain`` says of ``choice``'s weight."""
        if choice.recipe is None:
            return f"fp8: {choice.path} stays in high precision: {choice.why}"
        grads = str(GRAD_DTYPES[self.recipe]).removeprefix("torch.")
        formats = f"float8_e4m3fn activations and weights, {grads} grads, dynamic scales"
        keep = "the param, its grad and its optimizer state keep their dtype"
        if choice.kind == "experts":
            per_expert = ", one per expert" if self.recipe == "tensorwise" else ""
            return (
                f"{self}: the routed experts {choice.path} compute their grouped GEMMs' "
                f"output, input grad and weight grad in fp8 ({formats}{per_expert}); {keep}"
            )
        return (
            f"{self}: {choice.path} computes its output, input grad and weight grad in fp8 "
            f"({formats}); {keep}"
        )

    def runtime(self, plan: Plan, model: Model | None) -> Fp8Runtime:
        chosen = [c for c in self.choices(plan, model) if c.recipe is not None]
        paths = tuple(c.path for c in chosen if c.kind == "linear")
        experts = tuple(dict.fromkeys(c.path for c in chosen if c.kind == "experts"))
        return Fp8Runtime(paths, self.recipe, experts)


def fp8(
    mesh: DeviceMesh | None = None,
    recipe: str = "tensorwise",
    *,
    include: str | None = None,
    exclude: str | None = None,
    gather_in_fp8: bool = False,
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
    blocks), routers (linears named ``router`` or ``gate``), linears with a dim that is
    not a multiple of 16, weights computed in float64 and ``nn.Linear`` subclasses with a
    ``forward`` of their own; ``step.plan`` has an ``fp8`` column and ``plan.explain(path)``
    says why a linear does not. ``d9d.moe``'s routed experts compute their grouped GEMMs'
    three matmuls in fp8 too (tensorwise: one scale per expert), chosen by their experts
    module's path. Composes with ``shard_params``, ``tensor_parallel`` (each rank scales its
    shard), ``expert_parallel``, ``context_parallel``, ``pipeline``, ``remat`` and
    ``d9d.jit`` (``docs/fp8.md``).

    Args:
        mesh: The mesh, when no other transform of the step gives it (as for ``remat``).
        recipe: ``"tensorwise"`` (default), ``"rowwise"`` or ``"blockwise"``.
        include: A regex: only linears and experts modules whose module path it matches
            (``re.search``).
        exclude: A regex: linears and experts modules whose module path it matches stay in
            high precision.
        gather_in_fp8: Under ``shard_params`` (ZeRO-3), all-gather the weights of the
            linears and routed experts in fp8 as float8_e4m3fn data (1 byte per element)
            plus a scale from the whole weight's amax, one per expert for the experts' (one
            all-reduce of a float32 per weight and expert, once a step), which the fp8
            GEMMs take as they are; the step equals the one without it bitwise
            (``docs/fp8.md``). Tensorwise only; default False.

    Returns:
        The transform: decorate a step with it.

    Raises:
        PlanError: An unknown recipe or a pattern that is no regex; ``gather_in_fp8`` with
            another recipe than tensorwise; when placed, a pattern that matches no linear or
            experts module, no model given to ``place``, or ``gather_in_fp8`` where no fp8
            weight is all-gathered.

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
    return Fp8(mesh, recipe, include, exclude, gather_in_fp8)
