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

from ..errors import DonatedTreeError, PlanError, RecompileError
from ._context import current, running
from ._donation import (
    alias_and_mark,
    check_copies_apart,
    check_like,
    check_new_leaves_apart,
    check_not_donated,
    check_outputs_apart,
    copy_into,
    donated_memory,
)
from ._index_checks import guard_indices
from ._step import OutermostStep, TransformedStep

__all__ = ["Jitted", "jit"]


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
        check_copies_apart(graph)
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
            check_new_leaves_apart(args, out, self.donate)
        for i in self.donate:  # every check before the first copy: a refusal writes nothing
            check_like(args[i], out[i], argnum=i)
        for i in self.donate:
            copy_into(args[i], out[i])
        return tuple(None if i in self.donate else o for i, o in enumerate(out))

    def __call__(self, *args: Any) -> Any:
        for i, arg in enumerate(args):  # any argument: a donated batch leaf reads new values too
            check_not_donated(arg, name=f"argument {i}")
        donated = donated_memory(args, self.donate)
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
            results[i] = alias_and_mark(args[i], self.calls)
        check_outputs_apart(args, results, donated, self.donate)
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
    alive); the returned trees alias those buffers. The trees passed in then hold the new
    values: passing one to a d9d entry point (any jitted or eager step, ``place``,
    ``value_and_grad``, ``Model.apply``, ``checkpoint.save``) raises :class:`~d9d.errors.DonatedTreeError`,
    and other code reading one reads the new values (``.clone()`` what must outlive the call
    before it).

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
        DonatedTreeError: An argument holds a leaf donated to an earlier call; two donated
            leaves share memory; or the step returns a donated input (or a view of one) as
            another donated leaf or as an output that is not donated (return a ``.clone()``).
        IndexRangeError: An integer input (token ids, labels) indexes past the embedding or
            logits it looks up, checked inside the graph before the lookup; the donated trees
            are left as they were.
        RecompileError: With ``fail_on_recompile``, a call would trace the step again.
        TypeError: The step returns a donated tree laid out otherwise than the one it was
            given (other paths or containers), or a donated leaf of another shape or dtype,
            or that is not a tensor; nothing is written.
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
