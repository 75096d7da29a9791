"""``grad`` and ``value_and_grad`` over the first argument's pytree, on ``torch.autograd.grad``.

Why ``torch.autograd.grad`` and not ``torch.func.grad``: the latter cannot create DTensors
inside its transform, so sharded params fail, while ``autograd.grad`` differentiates DTensor
leaves like any tensor; under ``d9d.jit`` Dynamo traces it into the same graph as the forward
and the optimizer update (``trace_autograd_ops``), see docs/decisions.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import tree
from ..errors import IndivisibleError
from ._accumulated_dtype import accumulated_dtype
from ._apply import released_calls
from ._backward_region import backward_region
from ._context import StepContext, count_tokens, current, differentiating, record_step_tokens
from ._donation import check_not_donated
from ._embedding_ids import named_inputs
from ._gather import gather_params, local_like
from ._grad_reduce import reduce_to
from ._hidden_tensors import refuse_hidden_tensors
from ._plan import Plan
from ._runtime import Differentiation, Inputs

__all__ = ["averageable", "grad", "split_microbatches", "stack_aux", "value_and_grad"]


def value_and_grad(fn: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
    """Wrap ``fn(params, *args)`` to return its value and its gradient w.r.t. ``params``.

    ``fn`` must return a 0-d floating tensor (or ``(value, aux)`` with ``has_aux=True``). Grads
    come back as a tree shaped like ``params`` (the same paths, DTensor placements where the
    params are DTensors); a leaf that does not influence the value gets zeros. The value and aux
    are detached.

    Args:
        fn: The function to differentiate; its first argument is a pytree of float tensors.
        has_aux: ``fn`` returns ``(value, aux)``; aux is returned untouched but detached.

    Returns:
        A function returning ``(value, grads)``, or ``((value, aux), grads)`` with ``has_aux``.

    Raises:
        TypeError: A params leaf is not a floating tensor, or ``fn`` does not return a 0-d
            floating tensor.
        DonatedTreeError: (called eagerly) a params leaf was donated to an earlier
            ``d9d.jit`` call, so its buffer holds that call's new values.

    Example:
        >>> f = value_and_grad(lambda p, x: (p["w"] * x).sum())
        >>> f({"w": torch.ones(2)}, torch.tensor([3.0, 4.0]))
        (tensor(7.), {'w': tensor([3., 4.])})
    """

    @functools.wraps(fn)
    def wrapped(params: Any, *args: Any, **kwargs: Any) -> Any:
        # No PyTreeSpec is kept across a call into ``fn``: when ``fn`` breaks a ``jit`` graph,
        # Dynamo resumes in eager code with the values its trace made, and a spec it made
        # comes back as its own stand-in object, which cannot unflatten (optree raises
        # ``length mismatch``; torch 2.11 and 2.13). So each frame flattens ``params`` itself.
        pairs = tree.leaves_with_paths(params)
        # Outside a step, as Model.apply: a step's call (or d9d.jit's) checked its inputs.
        if current() is None and not torch.compiler.is_compiling():
            check_not_donated(params, name="value_and_grad's params")
        for path, leaf in pairs:
            if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
                kind = f"dtype {leaf.dtype}" if isinstance(leaf, torch.Tensor) else type(leaf)
                raise TypeError(
                    f"cannot differentiate params leaf {path!r} of {kind}: value_and_grad "
                    "needs floating tensors; move it out of the first argument"
                )
        step = current()
        driver = (
            next((r for r in step.runtimes if r.drives_differentiation), None) if step else None
        )
        if driver is None:
            with named_inputs(fn, args, kwargs):
                value, aux, grads, weight = _differentiate(
                    fn, params, args, kwargs, has_aux=has_aux
                )
        else:
            job = Differentiation(
                fn=fn,
                pairs=pairs,
                args=args,
                kwargs=kwargs,
                has_aux=has_aux,
                run=functools.partial(_differentiate, fn, params, has_aux=has_aux),
                split=functools.partial(split_microbatches, args, kwargs),
                check_value=functools.partial(_check_value, has_aux=has_aux),
                gather=functools.partial(_gather_once, step, [leaf for _, leaf in pairs]),
                leaves=functools.partial(_driven_leaves, params),
            )
            # The calls a driver makes outside ``_differentiate`` (a pipeline stage's).
            eager = not torch.compiler.is_compiling()
            with named_inputs(fn, args, kwargs), released_calls(step, eager):
                value, aux, grads, weight = driver.differentiate(job)
        plan = step.plan if step is not None else None
        grads = [_like(g, leaf, path, plan) for g, (path, leaf) in zip(grads, pairs, strict=True)]
        for runtime in step.runtimes if step is not None else ():
            value, grads = runtime.reduce_differentiated(value, grads, weight)
        # Rounded once, after every reduction: wide grads (StepContext.wide_grads) are
        # reduced over replica groups in their accumulated dtype.
        grads = [g.to(leaf.dtype) for g, (_, leaf) in zip(grads, pairs, strict=True)]
        grads = tree.with_leaves(params, grads)
        return ((value, aux), grads) if has_aux else (value, grads)

    return wrapped


def _differentiate(
    fn: Callable[..., Any],
    params: Any,
    args: Any,
    kwargs: Any,
    weighted: bool = False,
    into: list[torch.Tensor] | None = None,
    *,
    has_aux: bool,
) -> tuple[torch.Tensor, Any, list[torch.Tensor], torch.Tensor | None]:
    """``(value, aux, grads, weight)``; ``weight`` is the valid-token count the value's token
    means recorded (None if none did; added to the running step's ``tokens``), and with
    ``weighted`` the grads are those of ``weight * value``, ready to be summed over
    microbatches. With ``into`` (grads of an earlier call, laid out as these) each grad is
    added into its tensor in place as the backward produces it, and that tensor is returned
    as the grad (:func:`_grads`)."""
    leaves = tree.leaves(params)
    wide = _summed_wider(params, len(leaves))
    eager = not torch.compiler.is_compiling()
    with released_calls(current(), eager), torch.enable_grad(), count_tokens() as counts:
        # Inline, not ``_as_inputs``: when a check raises while Dynamo traces ``fn`` (a param
        # of the wrong shape), Dynamo runs the step eagerly and compiles each small function
        # it meets there on its own; the error should come before any compile (test_jit.py).
        inputs = [
            _differentiable(leaf) if dtype is None else _widened(leaf, dtype)
            for leaf, dtype in zip(leaves, wide, strict=True)
        ]
        with differentiating(leaves, inputs):
            out = fn(tree.with_leaves(params, inputs), *args, **kwargs)
        value, aux = out if has_aux else (out, None)
        _check_value(value, has_aux=has_aux)
        _check_differentiable(value)
        weight = torch.stack(counts).sum().to(value.dtype) if counts else None
        scaled = value * weight if weighted and weight is not None else value
        grads = _grads_of(scaled, inputs, into or [])
    record_step_tokens(counts)  # as counted: a bfloat16 weight rounds counts above 256
    aux = tree.map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, aux)
    return value.detach(), aux, list(grads), weight


def _gather_once(
    step: StepContext, given: list[torch.Tensor], paths: list[str], leaves: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``Differentiation.gather``: the compute tensors of ``paths`` from ``leaves`` (made of
    ``given``), from the first runtime that gathers them itself, else gathered by the plan."""
    params = dict(zip(paths, leaves, strict=True))
    with differentiating(given, leaves):
        for runtime in step.runtimes:
            found = runtime.gather_once(paths, params)
            if found is not None:
                return found
    return gather_params(step.plan, paths, params)


def _mark_differentiable(leaf: torch.Tensor) -> torch.Tensor:
    """``leaf`` detached, as a new autograd leaf for ``autograd.grad`` to differentiate."""
    return leaf.detach().requires_grad_(True)


def _summed_wider(params: Any, count: int) -> list[torch.dtype | None]:
    """Per leaf of ``params`` (``count`` of them): the dtype its microbatch grads are summed
    in (:func:`accumulated_dtype`) where that is wider than the leaf's own, while the running
    step defers reductions or holds its grads wide (``StepContext.wide_grads``), else None.

    Autograd casts a grad to the dtype of the input it is for: differentiated w.r.t. a bf16
    leaf (bf16 params, ``reduce_dtype=torch.float32``) each microbatch's grad was rounded to
    bf16 and the sums were bf16 ones. The leaf is then differentiated as a copy in the wider
    dtype, which the gathers cast back to the stored dtype (exactly: the values are the
    leaf's); ``step.memory`` counts the copies (``widened_params``)."""
    step = current()
    if step is None or not (step.defer_reduction or step.wide_grads):
        return [None] * count
    out: list[torch.dtype | None] = []
    for path, leaf in tree.flatten_with_paths(params)[0]:
        entry = step.plan.entries.get(path)
        wide = None if entry is None else accumulated_dtype(entry)
        out.append(wide if wide is not None and wide != leaf.dtype else None)
    return out


def _as_inputs(leaves: list[torch.Tensor], wide: list[torch.dtype | None]) -> list[torch.Tensor]:
    """``leaves`` as new autograd leaves, each copied to its ``wide`` dtype where it has one."""
    return [
        _differentiable(leaf) if dtype is None else _widened(leaf, dtype)
        for leaf, dtype in zip(leaves, wide, strict=True)
    ]


def _driven_leaves(params: Any) -> list[torch.Tensor]:
    """``Differentiation.leaves``: the autograd leaves a driver differentiates of ``params``,
    widened as ``_differentiate`` widens its own (:func:`_summed_wider`)."""
    leaves = tree.leaves(params)
    return _as_inputs(leaves, _summed_wider(params, len(leaves)))


def _widen(leaf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``leaf`` copied to ``dtype``, as a new autograd leaf (:func:`_summed_wider`)."""
    return leaf.detach().to(dtype).requires_grad_(True)


def _grads(
    value: torch.Tensor, inputs: list[torch.Tensor], into: list[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """The grads of ``value`` w.r.t. ``inputs``; with ``into`` (one tensor per input), each
    input's grad is added into its tensor in place when the backward has computed it, and
    the backward drops it there: a microbatch's grads never exist whole beside the running
    sum, as FSDP2 accumulates into ``.grad`` (docs/sharding.md). An input that the value does
    not use gets zeros, not its ``into`` tensor."""
    pairs = zip(inputs, into, strict=True) if into else ()
    handles = [x.register_hook(functools.partial(_added_into, t)) for x, t in pairs]
    try:
        with backward_region():
            return torch.autograd.grad(value, inputs, allow_unused=True, materialize_grads=True)
    finally:
        for handle in handles:
            handle.remove()


def _added_into(total: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A leaf's hook: ``grad`` added into ``total`` in place, which ``autograd.grad`` then
    returns in its stead (the same sum as ``total + grad``, bit for bit)."""
    return total.add_(grad)


# Each is one opaque node of a ``jit`` graph (``allow_in_graph``), which AOTAutograd traces
# like any op. torch 2.11's Dynamo cannot trace them itself: it graph-breaks on every
# ``requires_grad_`` ("Dynamo does not support changes to a Tensor's requires_grad"), which
# split each jitted step in two, and its ``autograd.grad`` handler asserts that every input
# is a FakeTensor, which a DTensor param is not (an AssertionError for every sharded step).
# ``disable(recursive=False)`` keeps Dynamo from compiling their own frames when they run
# eagerly after a graph break elsewhere, where 2.11 compiled a graph per call.
_differentiable = torch.compiler.allow_in_graph(
    torch.compiler.disable(_mark_differentiable, recursive=False)
)
_widened = torch.compiler.allow_in_graph(torch.compiler.disable(_widen, recursive=False))
_grads_of = torch.compiler.allow_in_graph(torch.compiler.disable(_grads, recursive=False))


def split_microbatches(args: tuple[Any, ...], kwargs: dict[str, Any], parts: int) -> list[Inputs]:
    """``parts`` slices (along dim 0) of ``(args, kwargs)``.

    The keyword dict is rebuilt by hand, not flattened: Dynamo's optree polyfill cannot flatten
    a dict created inside the traced step (``**kwargs`` is one), and broke the graph of every
    accumulating step under ``jit``.

    Raises:
        IndivisibleError: Tensors disagree on dim 0, or it does not divide into ``parts``.
        TypeError: A leaf hides tensors from the pytree (a dataclass; a mapping not a dict).
    """
    rows = _batch_rows(args, kwargs, parts) if parts > 1 else None
    arg_parts = _split_tree(args, parts, "argument", rows)
    kwarg_parts = {k: _split_tree(v, parts, f"argument {k}", rows) for k, v in kwargs.items()}
    return [
        (arg_parts[i], {k: chunks[i] for k, chunks in kwarg_parts.items()}) for i in range(parts)
    ]


def _batch_rows(args: tuple[Any, ...], kwargs: dict[str, Any], parts: int) -> int | None:
    """The examples (dim 0) every tensor argument of rank >= 1 holds, None where there is
    none; raise unless they agree, as ``check_batch`` asks of the step's batch: one built
    inside the step (a mask or weights per position, ``[S]``) was cut along its own dim 0,
    each microbatch taking a piece."""
    trees = [("argument", args), *((f"argument {k}", v) for k, v in kwargs.items())]
    sizes = {
        leaf.shape[0]
        for _, value in trees
        for leaf in tree.leaves(value)
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0
    }
    if len(sizes) < 2:
        return next(iter(sizes), None)
    found = {
        f"{what} {path}".strip(): leaf.shape[0]
        for what, value in trees
        for path, leaf in tree.flatten_with_paths(value)[0]
        if isinstance(leaf, torch.Tensor) and leaf.ndim > 0
    }
    raise IndivisibleError(
        f"the tensors d9d.value_and_grad's function is given disagree on the batch size "
        f"(dim 0), along which {parts} microbatches split every one of them: {found}; pass "
        "only tensors of the batch (one row per example), and keep a tensor shared by every "
        "example (a mask or weights per position) in the function's closure"
    )


def _split_tree(value: Any, parts: int, what: str, rows: int | None) -> list[Any]:
    """``parts`` slices of ``value`` along dim 0; leaves that are no tensor of rank >= 1 go
    whole to each, unless one hides a tensor of ``rows`` examples (or any, where ``rows`` is
    None) that the slices would have cut (``refuse_hidden_tensors``)."""
    named, spec = tree.flatten_with_paths(value)
    columns = []
    for path, leaf in named:
        if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0:
            if parts > 1:
                name = f"{what} {path!r}" if path else what
                refuse_hidden_tensors(name, leaf, f"{parts} microbatches", rows=rows)
            columns.append([leaf] * parts)
            continue
        if leaf.shape[0] % parts:
            raise IndivisibleError(
                f"{what} {path!r} holds {leaf.shape[0]} examples, which do not split into "
                f"{parts} microbatches; use a per-rank batch that is a multiple of {parts}"
            )
        columns.append(list(leaf.chunk(parts)))
    return [tree.unflatten(spec, [column[i] for column in columns]) for i in range(parts)]


def grad(fn: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
    """Wrap ``fn(params, *args)`` to return only its gradient w.r.t. ``params``.

    Same rules as :func:`value_and_grad`.

    Args:
        fn: The function to differentiate.
        has_aux: ``fn`` returns ``(value, aux)``; the wrapper then returns ``(grads, aux)``.

    Returns:
        A function returning ``grads`` (a tree like ``params``), or ``(grads, aux)``.

    Example:
        >>> grad(lambda p: (p["w"] ** 2).sum())({"w": torch.tensor([1.0, 2.0])})
        {'w': tensor([2., 4.])}
    """
    both = value_and_grad(fn, has_aux=has_aux)

    @functools.wraps(fn)
    def wrapped(params: Any, *args: Any, **kwargs: Any) -> Any:
        out, grads = both(params, *args, **kwargs)
        return (grads, out[1]) if has_aux else grads

    return wrapped


def stack_aux(auxes: list[Any], weights: list[torch.Tensor | None] | None = None) -> Any:
    """The aux of several microbatches as one: 0-d leaves averaged, others concatenated.

    With ``weights`` (each microbatch's valid-token count, as its value is weighed), 0-d
    leaves are averaged with those weights, so that a per-token mean in the aux (the cross
    entropy beside an aux loss) is the mean over the step's tokens, like the value. An
    integer or boolean 0-d leaf (a token count) is averaged in float64 (:func:`averageable`).

    Raises:
        TypeError: An aux leaf is not a tensor (a Python number cannot be averaged in the
            step's graph).
    """
    share = None
    if weights and all(w is not None for w in weights):
        total = torch.stack(weights)
        share = total / total.sum().clamp(min=1)

    def combine(*xs: Any) -> torch.Tensor:
        if not isinstance(xs[0], torch.Tensor):
            _refuse_aux_leaf(auxes[0])
        if xs[0].ndim:
            return torch.cat(xs)
        stacked = averageable(torch.stack(xs))
        return stacked.mean(0) if share is None else (stacked * share.to(stacked.dtype)).sum(0)

    return tree.map(combine, *auxes)


def averageable(x: torch.Tensor) -> torch.Tensor:
    """``x``, or ``x`` in float64 if it is an integer or boolean tensor: a mean over ranks or
    microbatches of a count needs a floating dtype (in ``x``'s own it truncated to 0, or
    raised), and float64 holds every count exactly."""
    return x if x.is_floating_point() or x.is_complex() else x.to(torch.float64)


def _refuse_aux_leaf(aux: Any) -> None:
    """Raise for the first aux leaf of ``aux`` that is not a tensor."""
    path, leaf = next((p, x) for p, x in tree.flatten_with_paths(aux)[0] if not torch.is_tensor(x))
    raise TypeError(
        f"aux leaf {path!r} is a {type(leaf).__name__}, not a tensor: over microbatches "
        "value_and_grad averages 0-d aux tensors and concatenates the others; return it as a "
        "tensor (torch.tensor(...)), or from the step body outside value_and_grad"
    )


def _check_value(value: Any, *, has_aux: bool) -> None:
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.is_floating_point():
        return
    hint = "return (value, aux) " if has_aux else "return a scalar loss, or pass has_aux=True, "
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise TypeError(
        f"the differentiated function must return a 0-d float tensor, got {shape}; {hint}"
    )


def _check_differentiable(value: torch.Tensor) -> None:
    """Raise, naming the causes, if autograd cannot differentiate ``value`` (its own error
    says only that element 0 does not require grad)."""
    if not value.requires_grad:
        raise ValueError(
            "the differentiated function's value does not depend on the params through "
            "autograd: it was computed under torch.no_grad() or torch.inference_mode(), from "
            "detached tensors (.detach(), .item(), .data), or from no param; compute the loss "
            "from the params passed in"
        )


def _like(grad: torch.Tensor, param: torch.Tensor, path: str, plan: Plan | None) -> torch.Tensor:
    """The grad laid out like its param (in its own dtype, which ``value_and_grad`` rounds to
    the param's after the runtimes' reductions): a ``Partial`` DTensor grad is reduced here.

    Under a plan the step body sees a param laid out as its optimizer state is kept
    (``state_kept``: ZeRO-1/2 update a shard of a param stored whole); its grad is reduced
    to where the plan keeps it (``grad_kept``), then taken to that layout (from a whole
    grad, this rank's slice: no communication). Those placements are read from the plan:
    reading them from the param would make ``jit`` guard on the identity of the param's
    placement objects, which each step's update creates anew.
    """
    if isinstance(grad, DTensor):
        entry = plan.entries.get(path) if plan is not None else None
        placements = entry.state_kept if entry is not None else tuple(param.placements)
        if tuple(grad.placements) != placements:
            kept = entry.grad_kept if entry is not None else placements
            reduce = grad.dtype if entry is None else entry.reduce_dtype or entry.dtype
            if grad.dtype != reduce and any(p.is_partial() for p in grad.placements):
                # Summed over microbatches in their accumulated dtype, reduced in this one.
                grad = local_like(grad.to_local().to(reduce), grad)
            grad = reduce_to(grad, kept)
            if tuple(grad.placements) != placements:
                grad = grad.redistribute(grad.device_mesh, placements)
    return grad
