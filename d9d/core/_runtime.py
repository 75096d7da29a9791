"""The runtime protocol: how a transform takes part in one step's execution.

A transform's :meth:`~d9d.transforms.Transform.runtime` may return a :class:`Runtime`. The
core calls every runtime, in transform order, at these places and never names a transform:

- on the params and optimizer state the step was called with, before anything else
  (:meth:`Runtime.start_step`: a runtime may hand in others, e.g. a peer's live state),
  and on those it returns (:meth:`Runtime.end_step`);
- on the batch, before the step body runs (:meth:`Runtime.on_batch`);
- on the params, as the step body sees them and as the step returns them
  (:meth:`Runtime.enter_step`, :meth:`Runtime.exit_step`), and whether the step keeps its
  update (:meth:`Runtime.commit`);
- around differentiation: one runtime may drive ``d9d.value_and_grad`` itself (microbatch
  accumulation, the pipeline executor), given a :class:`Differentiation`; one that gathers
  the params once for all its microbatches (``Differentiation.gather``) lets another
  gather them its own way (:meth:`Runtime.gather_once`: ZeRO-1/2's whole params);
- around ``Model.apply``: :meth:`Runtime.enter_apply` sees the :class:`ApplyCall` before the
  forward (it may change its inputs, stand a module in for another, and intercept modules
  and blocks) and :meth:`Runtime.exit_apply` after it, raised or not;
- in model code that asks the running step for an op by name (:meth:`Runtime.op`, e.g.
  ``"attention"`` over the whole sequence);
- when the step is placed: what it does to the backward (:meth:`Runtime.traits`) and what
  it cannot run with (:meth:`Runtime.refusals`), matched by name across runtimes;
- under ``d9d.jit``: a refusal, config options, graph passes.

An interception runs around one module's forward for one call: ``enter`` may replace its
inputs, ``around`` runs the forward (``torch.utils.checkpoint`` does), ``exit`` may replace
its output. Interceptions of one module nest in registration order, the first outermost;
the core's own, which swaps a block's gathered params in, is the innermost.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..errors import PlanError
from ._plan import Plan
from ._structure import Block, Slot, Structure

__all__ = ["ApplyCall", "Differentiation", "Interception", "Runtime", "replace_activation"]

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
"""A module's ``(args, kwargs)``."""


def replace_activation(
    args: tuple[Any, ...], kwargs: dict[str, Any], path: str, fn: Callable[[Any], Any]
) -> Inputs:
    """``args``/``kwargs`` of the module at ``path`` with its activation input (the first
    positional tensor, the first tensor of a first positional tuple: a carried state such as
    :class:`d9d.models.moe.MoEState`, or ``hidden_states=``) replaced by ``fn`` of it."""
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    if args and isinstance(args[0], tuple) and args[0] and isinstance(args[0][0], torch.Tensor):
        state = args[0]
        values = (fn(state[0]), *state[1:])
        # A NamedTuple is rebuilt from fields, a plain tuple from an iterable.
        rebuilt = values if type(state) is tuple else type(state)(*values)
        return (rebuilt, *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise PlanError(
        f"cannot find the activation input of module {path!r}: it must take it as the first "
        "positional tensor, the first tensor of a first positional tuple, or as hidden_states="
    )


@dataclass(frozen=True)
class Interception:
    """Work around one module's forward during one ``Model.apply``.

    Attributes:
        enter: ``enter(args, kwargs) -> (args, kwargs) | None`` before the forward (None:
            inputs unchanged).
        exit: ``exit(output) -> output | None`` after it (None: output unchanged).
        around: ``around(forward, args, kwargs) -> output``, where ``forward(*args,
            **kwargs)`` runs the module (and the interceptions inside this one).
    """

    enter: Callable[[tuple[Any, ...], dict[str, Any]], Inputs | None] | None = None
    exit: Callable[[Any], Any] | None = None
    around: Callable[..., Any] | None = None


@dataclass(eq=False)
class ApplyCall:
    """One ``Model.apply`` inside a running step, as runtimes see it before the forward.

    Attributes:
        structure: The model's structure.
        plan: The step's plan.
        params: The params passed to ``apply`` (stored DTensors, or tensors already in their
            compute layout).
        args: The forward's positional inputs (runtimes may replace them).
        kwargs: Its keyword inputs (runtimes may replace them).
        stand_ins: ``{module path: module}`` run instead of the model's own for this call.
        interceptions: ``{module path: [Interception, ...]}``.
        overrides: ``(object, attribute, value)`` set for this call (e.g. a config's
            attention implementation).
        state: Per-runtime state of this call, keyed by runtime.
        gather: ``gather(block, paths) -> {path: tensor}``: the compute tensors of a
            block's params when it starts (``block`` None: the params outside blocks, when
            the forward starts). The core's gathers them there and then; a runtime may
            put its own in (one that issues gathers ahead, say).
        contexts: Context managers entered around the forward, inside the environment.
        innermost: ``{block path: Interception}``: the core's own, which swaps the block's
            gathered params in, inside every runtime's.
    """

    structure: Structure
    plan: Plan
    params: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    stand_ins: dict[str, nn.Module] = field(default_factory=dict)
    interceptions: dict[str, list[Interception]] = field(default_factory=dict)
    overrides: list[tuple[Any, str, Any]] = field(default_factory=list)
    state: dict[Any, Any] = field(default_factory=dict)
    gather: Callable[[Block | None, list[str]], dict[str, Any]] | None = None
    contexts: list[AbstractContextManager[Any]] = field(default_factory=list)
    innermost: dict[str, Interception] = field(default_factory=dict)

    def blocks(self) -> list[Block]:
        """The model's blocks this call runs (not stood in), in order."""
        return [b for b in self.structure.blocks if not self.stood_in(b.path)]

    def param_keys(self, slots: Iterable[Slot]) -> list[str]:
        """The param paths ``slots`` hold, each tied alias once."""
        return list(dict.fromkeys(self.structure.canonical(s.key) for s in slots))

    def within(self, context: AbstractContextManager[Any]) -> None:
        """Enter ``context`` around this call's forward."""
        self.contexts.append(context)

    def intercept(self, path: str, interception: Interception) -> None:
        """Run ``interception`` around the module at ``path`` for this call."""
        self.interceptions.setdefault(path, []).append(interception)

    def stand_in(self, path: str, module: nn.Module) -> None:
        """Run ``module`` instead of the model's module at ``path`` for this call (its params
        are not gathered)."""
        self.stand_ins[path] = module

    def override(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name = value`` for this call."""
        self.overrides.append((owner, name, value))

    def stood_in(self, path: str) -> bool:
        """Whether the module at ``path`` is a stand-in or inside one."""
        return any(path == p or path.startswith(p + ".") for p in self.stand_ins)

    @contextmanager
    def environment(self) -> Iterator[None]:
        """Within the block, the model runs as this call runs it: stand-ins and interceptions
        in place of its modules, overrides set. ``Model.apply`` enters it around the
        forward; a block recomputed in the backward (``remat``) enters it again."""
        modules = self.structure.modules
        swaps: list[tuple[nn.Module, str, nn.Module]] = []
        for path, module in self.stand_ins.items():
            swaps.append((*_home(modules, path), module))
        for path in dict.fromkeys((*self.interceptions, *self.innermost)):
            if path in self.stand_ins or not self.stood_in(path):
                parent, name = _home(modules, path)
                inner = self.stand_ins.get(path) or parent._modules[name]
                interceptions = self.interceptions.get(path, [])
                own = (self.innermost[path],) if path in self.innermost else ()
                swaps.append((parent, name, _Intercepted(inner, (*interceptions, *own))))
        saved_modules = [parent._modules[name] for parent, name, _ in swaps]
        # An attribute the owner's class gives (a method) is restored by deleting the
        # instance's, so the owner is left as it was found, not holding a bound method.
        saved_attrs = [
            (getattr(owner, name), name in getattr(owner, "__dict__", ()))
            for owner, name, _ in self.overrides
        ]
        try:
            for parent, name, module in swaps:
                parent._modules[name] = module
            for owner, name, value in self.overrides:
                setattr(owner, name, value)
            yield
        finally:
            for (owner, name, _), (value, own) in zip(self.overrides, saved_attrs, strict=True):
                if own or name not in getattr(owner, "__dict__", ()):
                    setattr(owner, name, value)
                else:
                    delattr(owner, name)
            for (parent, name, _), module in zip(swaps, saved_modules, strict=True):
                parent._modules[name] = module


def _home(modules: dict[str, nn.Module], path: str) -> tuple[nn.Module, str]:
    """The parent (from the structure's ``{path: module}``) of the module at ``path`` and its
    name there."""
    parent, _, name = path.rpartition(".")
    if not name:
        raise ValueError("a runtime cannot stand in for or intercept the root module itself")
    return modules[parent], name


class _Intercepted(nn.Module):
    """A module with interceptions around its forward, in its parent for one call. Other
    attributes are the module's own (model code reads e.g. a block's ``attention_type``)."""

    def __init__(self, inner: nn.Module, interceptions: tuple[Interception, ...]) -> None:
        super().__init__()
        self.training = inner.training
        # Not registered as a child: the stand-in holds no params of its own.
        self.__dict__["inner"] = inner
        self.__dict__["interceptions"] = interceptions

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _run(self.__dict__["inner"], self.__dict__["interceptions"], 0, args, kwargs)


def _run(
    inner: nn.Module,
    interceptions: tuple[Interception, ...],
    i: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Interception ``i`` around interceptions ``i + 1 ..`` around ``inner``."""
    if i == len(interceptions):
        return inner(*args, **kwargs)
    this = interceptions[i]
    if this.enter is not None:
        changed = this.enter(args, kwargs)
        if changed is not None:
            args, kwargs = changed
    if this.around is not None:
        out = this.around(functools.partial(_forward, inner, interceptions, i + 1), args, kwargs)
    else:
        out = _run(inner, interceptions, i + 1, args, kwargs)
    if this.exit is not None:
        changed = this.exit(out)
        if changed is not None:
            out = changed
    return out


def _forward(
    inner: nn.Module, interceptions: tuple[Interception, ...], i: int, *args: Any, **kwargs: Any
) -> Any:
    return _run(inner, interceptions, i, args, kwargs)


@dataclass(eq=False)
class Differentiation:
    """A ``d9d.value_and_grad`` call that a runtime drives.

    Attributes:
        fn: The differentiated function, ``fn(params, *args, **kwargs)``.
        pairs: ``(path, leaf)`` of the params, flattened.
        args: Its positional inputs.
        kwargs: Its keyword inputs.
        has_aux: ``fn`` returns ``(value, aux)``.
        run: ``run(args, kwargs, weighted, into=None) -> (value, aux, grads, weight)``: one
            forward and backward of ``fn`` on those inputs; ``weight`` is the valid-token
            count its token means recorded (None if none did); with ``weighted`` the grads
            are those of ``weight * value``; with ``into`` (grads of an earlier run, laid out
            as these, which it writes) each grad is added into its tensor in place as the
            backward makes it, and that tensor is returned as the grad.
        split: ``split(parts) -> [(args, kwargs), ...]``: equal slices (dim 0) of the inputs.
        check_value: ``check_value(value)`` raises unless ``fn``'s value is a 0-d float.
        gather: ``gather(paths, leaves) -> {path: tensor}``: the compute tensors of the
            params at ``paths`` from ``leaves``, autograd leaves the driver made of their
            ``pairs`` tensors (``leaves()``), gathered once for every microbatch it runs; in
            the backward their grads come back to ``leaves`` reduced to where the plan keeps
            them. The first runtime's :meth:`Runtime.gather_once` that answers, else the
            core's ``gather_params``.
        leaves: ``leaves() -> [tensor, ...]``: the autograd leaves to differentiate, one
            per ``pairs`` tensor: a detached alias, or a copy in the param's accumulated
            dtype where the running step holds its grads wide
            (``StepContext.wide_grads``), whose grad the driver then returns in that dtype,
            as ``run``'s own differentiation does.
    """

    fn: Callable[..., Any]
    pairs: list[tuple[str, torch.Tensor]]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    has_aux: bool
    run: Callable[..., tuple[torch.Tensor, Any, list[torch.Tensor], torch.Tensor | None]]
    split: Callable[[int], list[Inputs]]
    check_value: Callable[[Any], None]
    gather: Callable[[list[str], list[torch.Tensor]], dict[str, torch.Tensor]]
    leaves: Callable[[], list[torch.Tensor]]


class Runtime:
    """A transform's part in one step's execution; every hook's default does nothing.

    Attributes:
        drives_differentiation: This runtime runs ``d9d.value_and_grad`` itself
            (:meth:`differentiate`); at most one runtime of a step may.
        accumulates_grads: This runtime's differentiation holds every param's grad whole
            (in its compute layout, unreduced) from the first microbatch's backward and
            reduces their sum once a step (``step.memory``'s ``accumulated_grads``, in
            ``d9d.core._accumulated_dtype.accumulated_dtype``).
        defers_reduction: This runtime differentiates with the gathers' reductions deferred
            (``sum_microbatches(defer_reduction=True)``): ``d9d.value_and_grad``
            differentiates a param whose accumulated dtype is wider than its own as a copy
            in that dtype (``step.memory``'s ``widened_params``).
        widens_grads: This runtime reduces the grads further (over replica groups) in
            their accumulated dtype: its steps run with ``StepContext.wide_grads`` set, and
            ``d9d.value_and_grad`` (or the runtime driving it, through
            ``Differentiation.leaves``) differentiates such a param as a copy as under
            ``defers_reduction``, the grads rounded to the params' dtypes once, after
            :meth:`reduce_differentiated`.
        shared: A step that shares the plan (``TransformedStep.sharing_plan``: an eval step
            over the same params) runs this runtime too; False for one whose hooks belong to
            the training step alone (``fault_tolerant``'s quorum and commit vote).
        tokens_beyond_mesh: Words naming the processes outside the step's mesh that hold
            other tokens of the step, whose grads this runtime averages in
            (``fault_tolerant``'s replica groups), or None: statistics a module sums over
            ``plan.token_groups`` miss their tokens.
    """

    drives_differentiation: bool = False
    accumulates_grads: bool = False
    defers_reduction: bool = False
    widens_grads: bool = False
    shared: bool = True
    tokens_beyond_mesh: str | None = None

    def op(self, name: str) -> Callable[..., Any] | None:
        """The op model code asks the running step for by ``name``
        (:func:`d9d.core._context.step_op`) to use instead of its own, or None; the first runtime
        with one wins. ``"attention"``: ``attend(q, k, v, *, causal, scale)`` over the whole
        sequence; ``"sequence_length"``: ``whole(local)``, the length of the sequence of which
        the model gets ``local`` positions."""
        del name
        return None

    def traits(self) -> dict[str, str]:
        """``{trait: how}``: what this runtime does that another may be unable to run with
        (``"split backward"``: a block's backward runs in two autograd passes, input grads
        then weight grads), each with the words that say how."""
        return {}

    def refusals(self) -> dict[str, str]:
        """``{trait: why}``: the traits of other runtimes this one cannot run with, each
        with the words that say why; the step refuses the pair by name when placed."""
        return {}

    def start_step(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """The params and optimizer state the step starts from, given those it was called
        with (as stored); first of a step's hooks. A refused commit returns these. Default:
        the same; ``fault_tolerant`` returns a live peer's when its replica group rejoins."""
        return params, opt_state

    def end_step(self, params: Any, opt_state: Any) -> None:
        """Sees the params and optimizer state the step returns (as stored), after the
        commit vote; last of a step's hooks."""

    def on_batch(self, batch: Any) -> Any:
        """The batch the step body sees (this rank's part of it)."""
        return batch

    def enter_step(self, params: Any) -> Any:
        """The params the step body sees, from those the step was called with (as stored):
        each laid out as the plan keeps its optimizer state, where the update runs."""
        return params

    def exit_step(self, params: Any) -> Any:
        """The params the step returns, from those its body returned: laid out as stored."""
        return params

    def commit(self) -> bool:
        """Whether the step keeps its update; asked of every runtime once per step, after the
        params are laid out as stored (the asking may be a collective). If one says False,
        the step returns the params and optimizer state it was called with."""
        return True

    def differentiate(
        self, job: Differentiation
    ) -> tuple[torch.Tensor, Any, list[Any], torch.Tensor | None]:
        """``(value, aux, grads, weight)`` of ``job``; each grad laid out as its param's
        optimizer state is kept (``state_kept``: the stored layout but under ZeRO-1/2), in
        the dtype of its ``job.leaves()`` leaf (its accumulated one under wide grads). The
        value and grads are means over ``weight`` valid tokens (the count the loss's token
        means recorded), or over the inputs alike when ``weight`` is None."""
        raise NotImplementedError(f"{type(self).__name__} does not drive differentiation")

    def reduce_differentiated(
        self, value: torch.Tensor, grads: list[Any], weight: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[Any]]:
        """The value and grads ``d9d.value_and_grad`` returns, from those its
        differentiation made (driven by a runtime or not): means over ``weight`` valid
        tokens (None: no count), each grad laid out as its param's optimizer state is kept
        (in its accumulated dtype where the step holds its grads wide: ``value_and_grad``
        rounds it to the param's dtype after the last runtime's call). Called for every
        runtime, in transform order. Default: unchanged; a runtime that
        reduces over replica groups while another runtime drives averages them here."""
        del weight
        return value, grads

    def gather_once(self, paths: list[str], params: dict[str, Any]) -> dict[str, Any] | None:
        """The compute tensors of ``paths`` from ``params`` (autograd leaves made of the
        params the step body passed to ``value_and_grad``; the running step's
        ``differentiated`` pairs each with the tensor it was made of), for a driver that
        gathers them once for all its microbatches (:attr:`Differentiation.gather`: the
        pipeline executor), or None to leave them to the core. Their grads must come back
        to ``params`` in the backward, laid out as the plan keeps them (``grad_kept``, then
        ``state_kept``). ZeRO-1/2 compute with the whole stored params here."""
        del paths, params
        return None

    def enter_apply(self, call: ApplyCall) -> None:
        """Before ``Model.apply``'s forward: check, change inputs, stand in, intercept."""

    def exit_apply(self, call: ApplyCall) -> None:
        """After ``Model.apply``'s forward, whether it returned or raised."""

    def jit_refusal(self) -> str | None:
        """Why ``d9d.jit`` cannot compile a step with this runtime, or None."""
        return None

    def comms_refusal(self) -> str | None:
        """Why ``step.comms`` cannot count a step with this runtime (it runs one), or None."""
        return None

    def jit_config(self) -> dict[str, Any]:
        """Dynamo config options (``torch._dynamo.config``) this runtime needs set while
        ``d9d.jit`` traces its step."""
        return {}

    def graph_passes(self) -> tuple[Callable[[fx.GraphModule], fx.GraphModule], ...]:
        """Passes ``d9d.jit`` runs, in order, over the joint forward-backward graph it
        compiles with the inductor or aot_eager backend (runtimes in transform order)."""
        return ()

    def group_labels(self) -> dict[str, str]:
        """``{process group name: axis label}`` for groups that are not mesh axes, so that
        ``step.comms`` names their traffic."""
        return {}
