"""``remat`` at run time: the chosen blocks run under ``torch.utils.checkpoint``.

The checkpoint wraps the block's forward *inside* the other transforms' block work and
*around* the core's gathering of the block's params, so that the recomputation in the
backward gathers them again (as FSDP2 reshards and regathers) and no gathered param is kept.

Eager, the recomputation is a second forward of the block in the backward, run with the
call's environment entered again: the interceptions of the block's modules
(``tensor_parallel``'s collectives) are in place as in the forward.

Under ``d9d.jit`` Dynamo turns each checkpoint into a tagged region of the one
forward-loss-backward graph, and this runtime's graph pass (``_graph_pass.rematerialize``,
torch's ``remat_using_tags_for_fwd_loss_bwd_graph`` over d9d's graph) duplicates the
region's tagged nodes into the backward. The Python
work inside a region (the swap of gathered params into the block and back) happens once, at
trace time, and is not replayed, which Dynamo must be told
(``skip_fwd_side_effects_in_bwd_under_checkpoint``: :meth:`RematRuntime.jit_config`).
Ops that draw a seed (attention) are kept, not duplicated (``_policies.compiled_contexts``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import checkpoint

from ...core._runtime import ApplyCall, Interception, Runtime
from ._graph_pass import rematerialize
from ._policies import compiled_contexts, selective_contexts

__all__ = ["RematRuntime"]


class RematRuntime(Runtime):
    """Checkpoints every ``every``-th block (block index divisible by it) under ``policy``."""

    def __init__(self, policy: str, every: int) -> None:
        self.policy = policy
        self.every = every

    def enter_apply(self, call: ApplyCall) -> None:
        for block in call.structure.blocks:
            if block.index % self.every == 0 and not call.stood_in(block.path):
                around = functools.partial(self._checkpointed, call)
                call.intercept(block.path, Interception(around=around))

    def jit_config(self) -> dict[str, Any]:
        return {"skip_fwd_side_effects_in_bwd_under_checkpoint": True}

    def graph_passes(self) -> tuple[Callable[[fx.GraphModule], fx.GraphModule], ...]:
        return (rematerialize,)

    def refusals(self) -> dict[str, str]:
        if self.policy == "selective":
            # torch's selective checkpoint hands each kept output to one recomputation; a
            # second backward pass over the block recomputes it again and finds it consumed.
            why = (
                "a block's kept outputs serve one backward pass (torch's selective checkpoint "
                "consumes them): use remat('full'), which recomputes the block in each pass, "
                "or a schedule without zero bubble ('1f1b', 'interleaved_1f1b')"
            )
            return {"split backward": why}
        return {}

    def _checkpointed(
        self, call: ApplyCall, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        if torch.compiler.is_compiling():
            contexts = compiled_contexts(self.policy)
        else:
            contexts = functools.partial(_eager_contexts, call, self.policy)
        # The block's keywords reach it through the partial, not through ``checkpoint``,
        # which takes some for itself (``debug``, ``early_stop``, ``determinism_check``,
        # ``preserve_rng_state``): a block's ``debug=True`` was refused by torch, its
        # ``early_stop`` dropped without a word.
        block = functools.partial(forward, **kwargs) if kwargs else forward
        return checkpoint(block, *args, use_reentrant=False, context_fn=contexts)


def _eager_contexts(call: ApplyCall, policy: str) -> tuple[Any, Any]:
    if policy == "selective":
        forward, recompute = selective_contexts()
    else:
        forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
    return forward, _Recomputation(call, recompute)


class _Recomputation:
    """The call's environment (module interceptions) and ``inner``, for a recomputation;
    entered once per backward pass over the block (zero-bubble pipelines run two: input
    grads, then weight grads, and torch's checkpoint recomputes the block in each)."""

    def __init__(self, call: ApplyCall, inner: Any) -> None:
        self.call = call
        self.inner = inner
        self.stack: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self.call.environment())
        stack.enter_context(self.inner)
        self.stack.append(stack)

    def __exit__(self, *exc: Any) -> bool | None:
        return self.stack.pop().__exit__(*exc)
