"""A transform of the tests' own that counts the collectives of the graphs ``d9d.jit``
compiles, as ``step.comms`` counts an eager step's.

A dispatch mode (``CollectiveCounter``) cannot count them: while one is active, Dynamo does
not run the compiled graph. This transform's runtime adds a graph pass instead, which sees
every functional collective of the forward and backward graphs once, as each runs once a
step: the counts of one step, whatever the number of calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

import d9d
from d9d.core._comm_count import CommStats
from d9d.core._runtime import Runtime
from d9d.transforms import ParamPlan, Phase, Transform

__all__ = ["GraphCollectives", "assert_bitwise_in_one_graph", "eager_and_jitted"]


@dataclass(frozen=True)
class GraphCollectives(Transform):
    """Records the functional collectives of the graphs ``d9d.jit`` compiles (forward and
    backward, each node run once a step) into ``stats``, sized as ``step.comms`` sizes them
    (through its runtime's graph passes)."""

    name: ClassVar[str] = "graph_collectives"
    phase: ClassVar[Phase] = Phase.COMPUTE_FORM
    mesh: Any
    stats: CommStats

    def claimed_axes(self) -> tuple[str, ...]:
        return ()

    def rewrite(self, entry: ParamPlan) -> ParamPlan:
        return entry

    def runtime(self, plan: Any, model: Any) -> Runtime:
        axes = {self.mesh.get_group(a).group_name: a for a in self.mesh.mesh_dim_names}
        return GraphCollectivesRuntime(axes, self.stats)


class GraphCollectivesRuntime(Runtime):
    """Adds the counting pass to the graphs ``d9d.jit`` compiles."""

    def __init__(self, axes: dict[str, str], stats: CommStats) -> None:
        self.axes, self.stats = axes, stats

    def graph_passes(self) -> tuple:
        return (self._count,)

    def _count(self, graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
        kinds = {getattr(_c10d, op).default: kind for op, kind in _KINDS.items()}
        for node in graph.graph.nodes:
            kind = kinds.get(node.target) if node.op == "call_function" else None
            if kind is None:
                continue
            tensor = node.args[0].meta["val"]
            size = tensor.numel() * tensor.element_size()
            key = (kind, self.axes[node.args[-1]])
            self.stats.count[key] += 1
            self.stats.bytes[key] += size * node.args[1] if kind == "all_gather" else size
        return graph


_c10d = torch.ops._c10d_functional
_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
}


def eager_and_jitted(
    build: Callable[[], tuple[Any, Any, Any, Any]], data: list[Any], **jit_options: Any
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor], int, CommStats]]:
    """The step ``build()`` makes (``(mesh, step, model, opt)``) run over ``data`` eagerly,
    then under ``d9d.jit(**jit_options)``: for each, the losses, the whole final params, the
    traces (0 eager) and the collectives of one step (eager: ``step.comms``; jitted: its
    graphs')."""
    runs = []
    for jit in (False, True):
        mesh, step, model, opt = build()
        stats = CommStats()
        if jit:
            step = d9d.jit(GraphCollectives(mesh, stats)(step), **jit_options)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        if not jit:
            stats = step.comms(params, state, step.shard_batch(data[0]))
        losses = []
        for batch in data:
            params, state, metrics = step(params, state, step.shard_batch(batch))
            losses.append(metrics["loss"])
        full = {k: v.full_tensor() for k, v in params.items()}
        runs.append((torch.stack(losses), full, getattr(step, "traces", 0), stats))
    return runs


def assert_bitwise_in_one_graph(eager: tuple, jitted: tuple) -> None:
    """The jitted run of :func:`eager_and_jitted` traced one graph for all its steps (no
    graph break, no recompile) and equals the eager run bit for bit, losses and params,
    with the same collectives, count and bytes."""
    assert jitted[2] == 1, f"{jitted[2]} traces"
    assert torch.equal(jitted[0], eager[0]), (jitted[0], eager[0])
    for path, value in eager[1].items():
        assert torch.equal(jitted[1][path], value), path
    assert dict(jitted[3].count) == dict(eager[3].count)
    assert dict(jitted[3].bytes) == dict(eager[3].bytes)
