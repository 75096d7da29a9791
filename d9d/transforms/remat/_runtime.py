"""``remat`` at run time: the chosen blocks run under ``torch.utils.checkpoint``.

The checkpoint wraps the block's forward *inside* the other transforms' block work and
*around* the core's gathering of the block's params, so that the recomputation in the
backward gathers them again (as FSDP2 reshards and regathers) and no gathered param is kept.
The recomputation runs with the call's environment entered again: the interceptions of the
block's modules (``tensor_parallel``'s collectives) are in place as in the forward.

``d9d.jit`` refuses it for now (torch 2.13, measured). Inside the checkpointed region the
gathering swaps params into the block, which a checkpoint traced by Dynamo may not do (state
outside the region). With the gathering moved outside the region the step traces into one
graph, but AOT autograd then refuses to recompute attention (an RNG-seeded op) in d9d.jit's
forward-loss-backward graph; with attention's output kept, it refuses more than one
recomputed region in such a graph ("Detected 2 disjoint backward regions that require
recomputation"): one per checkpointed block.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.checkpoint import checkpoint

from ..._runtime import ApplyCall, Interception, Runtime
from ._policies import selective_contexts

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

    def jit_refusal(self) -> str:
        return (
            "d9d.jit does not compile a step with remat yet: torch cannot rematerialize a "
            "checkpointed block inside d9d.jit's one forward-loss-backward graph (see "
            "d9d/transforms/remat/_runtime.py); drop d9d.jit, or drop remat and compile"
        )

    def _checkpointed(
        self, call: ApplyCall, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        contexts = functools.partial(_eager_contexts, call, self.policy)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def _eager_contexts(call: ApplyCall, policy: str) -> tuple[Any, Any]:
    if policy == "selective":
        forward, recompute = selective_contexts()
    else:
        forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
    return forward, _entered(call, recompute)


@contextlib.contextmanager
def _entered(call: ApplyCall, inner: Any) -> Iterator[None]:
    """The call's environment (module interceptions) and ``inner``, for a recomputation."""
    with call.environment(), inner:
        yield
