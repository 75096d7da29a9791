"""``jit``: ``torch.compile`` of a whole training step, with donated inputs updated in place."""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch._dynamo.backends.debugging
import torch._dynamo.config
import torch._functorch.config
import torch._inductor.compile_fx
from torch.distributed.tensor import DTensor

from .. import tree
from ..errors import DonatedTreeError, PlanError, RecompileError
from ._context import current, running
from ._index_checks import guard_indices, source_name
from ._step import OutermostStep, TransformedStep

__all__ = ["Jitted", "jit"]

_DONATED = "_d9d_donated_at_call"


class Jitted(OutermostStep):
    """A step compiled by :func:`jit`; call it like the step it wraps.

    Attributes other than its own (``place``, ``plan``, ``comms`` of a transformed step) are
    read from the wrapped step. ``traces`` counts the graphs compiled for this step so far.
    """

    def __init__(
        self,
        step: Callable[..., Any],
        *,
        donate: Sequence[int],
        fail_on_recompile: bool,
        backend: str,
        compile_options: dict[str, Any],
    ) -> None:
        self.step = step
        self.donate = tuple(donate)
        self.fail_on_recompile = fail_on_recompile
        self.traces = 0
        self.calls = 0
        mode, dynamic = compile_options.pop("mode"), compile_options["dynamic"]
        if mode and backend != "inductor":
            raise ValueError(
                f"mode={mode!r} is an inductor option but backend={backend!r}; drop mode or "
                "use backend='inductor'"
            )
        inductor_options = torch._inductor.list_mode_options(mode, dynamic) if mode else {}
        self._compiler = _compiler(backend, inductor_options)
        # With these two backends d9d runs the runtimes' graph passes, one of which
        # rematerializes tagged regions in place of torch's own pass (which refuses d9d's
        # graphs: d9d/transforms/remat/_graph_pass.py).
        self._functorch_config = {
            "remat_using_tags_for_fwd_loss_bwd_graph": backend not in ("inductor", "aot_eager")
        }
        self._compiled = torch.compile(
            _own_code(self._donating_step), backend=self._backend, **compile_options
        )
        functools.update_wrapper(self, step, updated=())

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        _check_copies_apart(graph)
        guard_indices(graph)
        compiled = self._compiler(graph, example_inputs)
        # Counted once compiled: a compile that raises to restart the trace (inductor's
        # TensorifyScalarRestartAnalysis, when a Python float input cannot become a tensor)
        # is one graph traced twice, not two graphs.
        self.traces += 1
        return compiled

    def refusal_of(self, name: str) -> str:
        return (
            f"{name} was applied to a step already compiled by d9d.jit; jit must wrap "
            f"every transform: put @d9d.jit above the @d9d.{name}(...) decorator, or "
            f"write d9d.jit(d9d.{name}(...)(step))"
        )

    def __getattr__(self, name: str) -> Any:
        step = self.__dict__.get("step")
        if step is None:
            raise AttributeError(name)
        return getattr(step, name)

    def _donating_step(self, *args: Any) -> tuple[Any, ...]:
        out = self.step.run(*args) if isinstance(self.step, TransformedStep) else self.step(*args)
        if not isinstance(out, tuple) or len(out) <= max(self.donate, default=-1):
            raise TypeError(
                f"a step with donate={self.donate} must return a tuple whose item i replaces "
                f"argument i, got {type(out).__name__}; return (params, opt_state, metrics)"
            )
        if not torch.compiler.is_compiling():  # Dynamo gave up on this frame: checked here
            _check_new_leaves_apart(args, out, self.donate)
        for i in self.donate:  # every check before the first copy: a refusal writes nothing
            _check_like(args[i], out[i], argnum=i)
        for i in self.donate:
            _copy_into(args[i], out[i])
        return tuple(None if i in self.donate else o for i, o in enumerate(out))

    def __call__(self, *args: Any) -> Any:
        for i in self.donate:
            _check_not_donated(args[i], argnum=i)
        donated = _donated_memory(args, self.donate)
        context = None
        config: dict[str, Any] = {"trace_autograd_ops": True}
        if isinstance(self.step, TransformedStep):
            self.step.check_inputs(args[0], args[1], args[2])
            for runtime in self.step.runtimes:
                refusal = runtime.jit_refusal()
                if refusal is not None:
                    raise PlanError(refusal)
                config.update(runtime.jit_config())
            context = self.step.context()
        try:
            with (
                _shared_patch(torch._dynamo.config, config),
                _shared_patch(torch._functorch.config, self._functorch_config),
                self._stance(),
                running(context),
            ):
                out = self._compiled(*args)
        except RuntimeError as error:
            if isinstance(getattr(error, "inner_exception", None), PlanError | DonatedTreeError):
                raise error.inner_exception from None  # the compiler's refusal, unwrapped
            if self.fail_on_recompile and "fail_on_recompile" in str(error):
                raise RecompileError(
                    f"step {self.__name__!r} would be traced again on call {self.calls + 1}: "
                    f"{error}. Keep input shapes, dtypes and Python values fixed, or build "
                    "the jit without fail_on_recompile=True"
                ) from None
            raise
        self.calls += 1
        results = list(out)
        for i in self.donate:
            results[i] = _alias_and_mark(args[i], self.calls)
        _check_outputs_apart(args, results, donated, self.donate)
        return tuple(results)

    def _stance(self) -> Any:
        # The stance is process-wide while this call runs: with ranks as threads of one
        # process, a rank's first compile at that moment would be refused too.
        if self.fail_on_recompile and self.traces:
            return torch.compiler.set_stance("fail_on_recompile")
        return contextlib.nullcontext()


def jit(
    step: Callable[..., Any] | None = None,
    *,
    donate: Sequence[int] = (0, 1),
    fail_on_recompile: bool = False,
    fullgraph: bool = False,
    mode: str | None = None,
    dynamic: bool | None = False,
    backend: str = "inductor",
) -> Any:
    """Compile a whole training step with ``torch.compile``, updating donated inputs in place.

    The forward, the backward (``value_and_grad`` inside the step) and the optimizer update
    land in one graph. Argument ``i`` in ``donate`` is overwritten with output ``i`` (so
    ``(params, opt_state)`` are updated in their own buffers, with no second copy of the model
    alive); the returned trees alias those buffers, and passing an old donated tree again raises
    :class:`~d9d.errors.DonatedTreeError`.

    Args:
        step: ``step(params, opt_state, batch) -> (params, opt_state, metrics)``; may be used as
            a bare decorator or called with options only.
        donate: Argument indices updated in place; ``()`` returns fresh trees instead.
        fail_on_recompile: Raise :class:`~d9d.errors.RecompileError` instead of tracing again.
        fullgraph: Passed to ``torch.compile``: error on any graph break.
        mode: Passed to ``torch.compile`` (``"max-autotune"``, ...).
        dynamic: Passed to ``torch.compile``; ``False`` (default) specializes on shapes.
        backend: A ``torch.compile`` backend name. ``"inductor"`` (default) generates
            fused kernels; ``"aot_eager"`` runs the same captured forward+backward graph on
            eager kernels (no code generation: a quick check that a step captures).

    Returns:
        The compiled step (a :class:`Jitted`), called like ``step``.

    Raises:
        DonatedTreeError: An argument holds a tree donated to an earlier call; two donated
            leaves share memory; or the step returns a donated input (or a view of one) as
            another donated leaf or as an output that is not donated (return a ``.clone()``).
        IndexRangeError: An integer input (token ids, labels) indexes past the embedding or
            logits it looks up, checked inside the graph before the lookup; the donated trees
            are left as they were.
        RecompileError: With ``fail_on_recompile``, a call would trace the step again.
        ValueError: ``mode`` with a backend other than inductor.

    Example:
        >>> @jit(donate=())
        ... def double(params, opt_state, batch):
        ...     return params, opt_state, {"y": 2 * batch}
        >>> double({}, {}, torch.ones(2))[2]["y"]
        tensor([2., 2.])
    """
    options = {"fullgraph": fullgraph, "mode": mode, "dynamic": dynamic}

    def build(fn: Callable[..., Any]) -> Jitted:
        if isinstance(fn, OutermostStep) and not isinstance(fn, Jitted):
            raise PlanError(fn.refusal_of("jit"))
        return Jitted(
            fn,
            donate=donate,
            fail_on_recompile=fail_on_recompile,
            backend=backend,
            compile_options=dict(options),
        )

    return build if step is None else build(step)


# Inductor's CPU code runs a scatter-add (the backward of every gather, as in the cross
# entropy) in its own kernel, not as ATen's in-place scatter_reduce_ after it. torch 2.11's
# CPU fusion drops the ordering after such an in-place op when it fuses a later reader with
# a kernel of other loop sizes (pytorch/pytorch#177631, fixed by #177816 after 2.11): the
# jitted step read the logits' grad buffer before the scatter wrote it, so every grad was
# wrong (one-block Llama, float64: by up to 105%). The scatters are one element per token.
_INDUCTOR_PATCHES = {"cpp.fallback_scatter_reduce_sum": False}


# torch's config modules are process-wide, and their ``patch`` restores on exit what it
# found on entry: with ranks as threads, a rank leaving its call set the options back while
# another still traced (the compile lock lets one trace at a time), which then traced
# without remat's side-effect switch, broke its graph and ran collectives eagerly, alone
# (a hang). So the first call in sets the options and the last one out restores them.
_PATCH_LOCK = threading.Lock()
_PATCHED: dict[tuple[Any, str], list[Any]] = {}  # (config, name) -> [value, users, saved]


@contextlib.contextmanager
def _shared_patch(config: Any, options: dict[str, Any]) -> Iterator[None]:
    """Set ``options`` on the torch config module ``config`` while any call holding them runs.

    Raises:
        RuntimeError: A call running at the same time holds one of them at another value.
    """
    with _PATCH_LOCK:
        for name, value in options.items():
            held = _PATCHED.get((config, name))
            if held is not None and held[0] != value:
                raise RuntimeError(
                    f"two jitted calls running at once (ranks as threads) need "
                    f"{config.__name__}.{name} = {held[0]!r} and {value!r}; run steps that "
                    "need different options one after the other"
                )
        held_here: list[str] = []
        try:
            for name, value in options.items():
                held = _PATCHED.setdefault((config, name), [value, 0, getattr(config, name)])
                held[1] += 1
                held_here.append(name)
                setattr(config, name, value)
        except BaseException:  # an unknown option: give back what this call took
            _release(config, held_here)
            raise
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _release(config, held_here)


def _release(config: Any, names: list[str]) -> None:
    """One user fewer of each of ``names``; the last one out restores the saved value."""
    for name in names:
        held = _PATCHED[(config, name)]
        held[1] -= 1
        if not held[1]:
            setattr(config, name, held[2])
            del _PATCHED[(config, name)]


def _compiler(backend: str, inductor_options: dict[str, Any]) -> Callable[..., Any]:
    """The backend that compiles a step's graph. With inductor and aot_eager, the running
    step's runtimes' graph passes run over the joint graph first (:func:`_with_graph_passes`)."""
    if backend == "inductor":
        inner = _with_graph_passes(torch._inductor.compile_fx.compile_fx_inner)
        return functools.partial(
            torch._inductor.compile_fx.compile_fx,
            inner_compile=inner,
            config_patches={**inductor_options, **_INDUCTOR_PATCHES},
        )
    if backend == "aot_eager":
        nop = _with_graph_passes(torch._dynamo.backends.debugging.boxed_nop)
        return functools.partial(torch._dynamo.backends.debugging.aot_eager, fw_compiler=nop)
    return torch._dynamo.lookup_backend(backend)


def _with_graph_passes(compile_graph: Callable[..., Any]) -> Callable[..., Any]:
    """``compile_graph`` after the graph passes of the step running on this thread (the
    compile runs inside the call), in runtime order."""

    def compile_after_passes(graph: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        step = current()
        for runtime in step.runtimes if step is not None else ():
            for graph_pass in runtime.graph_passes():
                graph = graph_pass(graph)
        return compile_graph(graph, *args, **kwargs)

    return compile_after_passes


def _own_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` with a copy of its code object: Dynamo keeps compiled graphs, guards and its
    recompile limit per code object, so each jitted step gets a cache of its own."""
    fn = method.__func__
    copy = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    return types.MethodType(copy, method.__self__)


def _check_like(old: Any, new: Any, *, argnum: int) -> None:
    """Refuse a new donated tree not laid out like the old one, leaf shapes and dtypes too.

    Raises:
        TypeError: Another structure, or a leaf of another shape or dtype.
    """
    # Paths, not PyTreeSpec equality: this runs while Dynamo traces, and torch 2.11's Dynamo
    # cannot trace a spec comparison (its optree polyfill's __eq__).
    if not tree.same_paths(old, new):
        old_paths, new_paths = set(tree.paths(old)), set(tree.paths(new))
        missing, unexpected = sorted(old_paths - new_paths), sorted(new_paths - old_paths)
        raise TypeError(
            f"donated argument {argnum} is not laid out like the tree the step returned in its "
            f"place: {missing=} (paths the returned tree lacks), {unexpected=} (paths it "
            "adds); return a tree of the same structure"
        )
    for (path, a), b in zip(tree.flatten_with_paths(old)[0], tree.leaves(new), strict=True):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            raise TypeError(
                f"donated argument {argnum} leaf {path!r} is not a tensor but a "
                f"{type(a).__name__} (the step returned a {type(b).__name__}); jit writes each "
                "donated leaf's new value into its tensor: hold the value in a tensor "
                "(torch.tensor(...)), or build the jit with donate=()"
            )
        if a.shape != b.shape or a.dtype != b.dtype:
            raise TypeError(
                f"donated argument {argnum} leaf {path!r} is {a.dtype}{list(a.shape)} but the "
                f"step returned {b.dtype}{list(b.shape)}; a donated leaf keeps its shape and dtype"
            )


def _copy_into(old: Any, new: Any) -> None:
    """Each leaf of ``new`` copied into the matching leaf of ``old`` (checked alike first)."""
    # One copy_ per leaf, not torch._foreach_copy_: inductor (torch 2.13) lets a later output
    # read an input that _foreach_copy_ already overwrote (docs/decisions.md has the repro).
    for a, b in zip(tree.leaves(old), tree.leaves(new), strict=True):
        a.copy_(b)


def _check_not_donated(arg: Any, *, argnum: int) -> None:
    if not any(hasattr(leaf, _DONATED) for leaf in tree.leaves(arg)):
        return
    for path, leaf in tree.flatten_with_paths(arg)[0]:
        call = getattr(leaf, _DONATED, None)
        if call is not None:
            raise DonatedTreeError(
                f"argument {argnum} leaf {path!r} was donated to call {call} of this step and "
                "its buffer now holds newer values; pass the tree that call returned"
            )


# A buffer (its device and address) -> (argument, leaf index, leaf) of each donated leaf in it.
_Buffers = dict[tuple[torch.device, int], list[tuple[int, int, Any]]]


def _local(leaf: Any) -> torch.Tensor | None:
    """The tensor holding ``leaf``'s elements (a DTensor's local tensor); None for a leaf that
    is not a plain tensor or holds no memory."""
    local = leaf._local_tensor if isinstance(leaf, DTensor) else leaf
    if type(local) not in (torch.Tensor, torch.nn.Parameter) or local.is_meta:
        return None
    return local if local.numel() else None


def _buffer(local: torch.Tensor) -> tuple[torch.device, int]:
    return local.device, local.untyped_storage().data_ptr()


def _bytes(local: torch.Tensor) -> tuple[int, int]:
    """The first byte of its buffer ``local`` reads and one past its last."""
    start = local.storage_offset()
    end = start + 1 + sum((n - 1) * s for n, s in zip(local.shape, local.stride(), strict=True))
    return start * local.element_size(), end * local.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors on one buffer read some byte in common (spans, not elements: two
    interleaved views count as overlapping)."""
    (a_start, a_end), (b_start, b_end) = _bytes(a), _bytes(b)
    return a_start < b_end and b_start < a_end


def _leaf_name(arg: Any, index: int, *, kind: str, argnum: int) -> str:
    return f"{kind} {argnum} leaf {tree.flatten_with_paths(arg)[0][index][0]!r}"


def _donated_memory(args: Sequence[Any], donate: Sequence[int]) -> _Buffers:
    """The buffers of the donated leaves, after checking that no two leaves overlap: each is
    overwritten with its own new value, so one would overwrite the other's (the same tensor
    twice, or a view of another, gave both the last value written).

    Raises:
        DonatedTreeError: Two donated leaves share memory.
    """
    buffers: _Buffers = {}
    for i in donate:
        for index, leaf in enumerate(tree.leaves(args[i])):  # paths only for the message
            local = _local(leaf)
            if local is not None:
                buffers.setdefault(_buffer(local), []).append((i, index, local))
    for held in buffers.values():
        if len(held) < 2:
            continue
        spans = sorted((*_bytes(local), i, index) for i, index, local in held)
        reach, widest = spans[0][1], spans[0]
        for span in spans[1:]:
            if span[0] < reach:
                first, second = (
                    _leaf_name(args[i], index, kind="argument", argnum=i)
                    for _, _, i, index in (widest, span)
                )
                raise DonatedTreeError(
                    f"{first} and {second} share memory (one tensor passed twice, or a "
                    "view of another); jit writes each donated leaf's new value into its "
                    "own buffer, so one would overwrite the other: pass separate tensors "
                    "(clone one of them), or build the jit with donate=()"
                )
            if span[1] > reach:
                reach, widest = span[1], span
    return buffers


def _check_outputs_apart(
    args: Sequence[Any], results: Sequence[Any], donated: _Buffers, donate: Sequence[int]
) -> None:
    """Refuse an output (not donated) that shares memory with a donated leaf: the call has
    overwritten that leaf with its new value, where the eager step returns the old one.

    Raises:
        DonatedTreeError: An output leaf shares memory with a donated argument's leaf.
    """
    for k, out in enumerate(results):
        if k in donate:
            continue
        for index, leaf in enumerate(tree.leaves(out)):
            local = _local(leaf)
            for i, donated_index, other in (
                donated.get(_buffer(local), ()) if local is not None else ()
            ):
                if _overlap(local, other):
                    output = _leaf_name(out, index, kind="output", argnum=k)
                    argument = _leaf_name(args[i], donated_index, kind="argument", argnum=i)
                    raise DonatedTreeError(
                        f"{output} of the step shares memory with {argument} (it is that "
                        "tensor, or a view of it), which this call overwrote with its new "
                        "value; the eager step returns the old one: return a copy (.clone()) of "
                        "it. The donated trees passed to this call hold the new values and "
                        "are donated"
                    )


def _refuse_copy_of_donated(new: str, old: str) -> DonatedTreeError:
    return DonatedTreeError(
        f"the step returned, as the new value of {new}, a tensor that shares memory with "
        f"{old} (it is that tensor, or a view of it); jit overwrites each donated leaf in "
        "place, one after the other, so the value could be overwritten before it is copied: "
        "return a copy (.clone()) of it"
    )


def _check_new_leaves_apart(args: Sequence[Any], out: Sequence[Any], donate: Sequence[int]) -> None:
    """Refuse a new donated leaf that shares memory with another donated leaf (an eager run of
    :meth:`Jitted._donating_step`; :func:`_check_copies_apart` checks the compiled copies).

    Raises:
        DonatedTreeError: A new donated leaf is (a view of) another donated input leaf.
    """
    donated = _donated_memory(args, donate)
    for i in donate:
        for index, leaf in enumerate(tree.leaves(out[i])):
            local = _local(leaf)
            for j, other_index, other in (
                donated.get(_buffer(local), ()) if local is not None else ()
            ):
                if (j, other_index) != (i, index) and _overlap(local, other):
                    raise _refuse_copy_of_donated(
                        _leaf_name(args[i], index, kind="argument", argnum=i),
                        _leaf_name(args[j], other_index, kind="argument", argnum=j),
                    )


def _check_copies_apart(graph: torch.fx.GraphModule) -> None:
    """Refuse a copy into a step input (a donated leaf, :func:`_copy_into`) from a tensor that
    shares memory with another input copied into: the copies run one after the other, so
    one could read a buffer already overwritten (a step that kept the old params in its
    state, ``{"prev": params["w"]}``, kept the new ones).

    Raises:
        DonatedTreeError: A copy's source is (a view of) another donated leaf.
    """
    copies = [
        node
        for node in graph.graph.nodes
        if node.op == "call_method"
        and node.target == "copy_"
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].op == "placeholder"
    ]
    written: dict[Any, list[torch.fx.Node]] = {}
    for node in copies:
        local = _fake_local(node.args[0])
        if local is not None:
            written.setdefault(local.untyped_storage()._cdata, []).append(node.args[0])
    for node in copies:
        source = _fake_local(node.args[1])
        for target in (
            written.get(source.untyped_storage()._cdata, ()) if source is not None else ()
        ):
            if target is not node.args[0] and _may_overlap(source, _fake_local(target)):
                raise _refuse_copy_of_donated(source_name(node.args[0]), source_name(target))


def _fake_local(node: Any) -> torch.Tensor | None:
    """The (fake) tensor holding the elements of a graph node's value, or None."""
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    local = value._local_tensor if isinstance(value, DTensor) else value
    return local if isinstance(local, torch.Tensor) else None


def _may_overlap(a: torch.Tensor, b: Any) -> bool:
    """:func:`_overlap` of two fake tensors on one buffer; True where a size is symbolic."""
    sizes = (*a.shape, *a.stride(), *b.shape, *b.stride(), a.storage_offset(), b.storage_offset())
    return not all(isinstance(size, int) for size in sizes) or _overlap(a, b)


def _alias_and_mark(arg: Any, call: int) -> Any:
    leaves, spec = tree.flatten(arg)
    fresh = [_alias(leaf) for leaf in leaves]
    for leaf in leaves:
        setattr(leaf, _DONATED, call)
    return tree.unflatten(spec, fresh)


def _alias(leaf: Any) -> Any:
    """A new tensor object on ``leaf``'s buffer, a DTensor on ``leaf``'s own mesh object.

    Not ``DTensor.detach``: after a compiled call it returned ZeRO-1's optimizer state on
    another, equal mesh object, and Dynamo guards a mesh by identity, so the next call
    traced the step again (docs/decisions.md).
    """
    if not isinstance(leaf, DTensor):
        return leaf.detach()
    return DTensor.from_local(
        leaf.to_local().detach(),
        leaf.device_mesh,
        leaf.placements,
        run_check=False,
        shape=leaf.shape,
        stride=leaf.stride(),
    )
