"""Expert parallelism at run time: each experts module's call ``(rows grouped by expert,
group_sizes [E])`` becomes dispatch, the local experts' forward, and combine.

The interception sits around the experts module (``d9d.moe``'s ``Experts``), inside the
block whose params the core has already swapped in: the module computes with this rank's
``E / ep`` experts, on the rows the other ep ranks sent for them, grouped by local expert.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ...core._runtime import ApplyCall, Interception, Runtime
from ...moe import Experts
from ._dispatch import combine, dispatch, route_rows

__all__ = ["ExpertParallelRuntime"]


class ExpertParallelRuntime(Runtime):
    """The runtime of ``expert_parallel``: intercepts the experts modules at ``modules``."""

    def __init__(self, modules: tuple[str, ...], ranks: int, group_name: str) -> None:
        self.modules = modules
        self.ranks = ranks
        self.group_name = group_name

    def enter_apply(self, call: ApplyCall) -> None:
        for path in self.modules:
            if not call.stood_in(path):
                call.intercept(path, Interception(around=self._experts))

    def jit_refusal(self) -> str | None:
        return (
            "expert_parallel reads each step's all-to-all split sizes (the routing) on the host, "
            "which d9d.jit does not trace yet (worst-case static buffers or unbacked sizes, "
            "issue 27): run the step eagerly"
        )

    def _experts(self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> Any:
        # Experts.forward(x, group_sizes), its inputs passed by position or by name.
        inputs = _SIGNATURE.bind(None, *args, **kwargs).arguments
        rows, group_sizes = inputs["x"], inputs["group_sizes"]
        route = route_rows(group_sizes, self.ranks, self.group_name, rows.shape[0])
        return combine(forward(dispatch(rows, route), route.local_sizes), route)


_SIGNATURE = inspect.signature(Experts.forward)
