"""A compiled ``update`` + ``apply_updates`` traces once: 0-d step tensors never recompile it."""

from __future__ import annotations

import pytest
import torch

import d9d.optim as optim
from d9d.errors import OptimTreeMismatchError

PARAMS = {"blocks.0.bias": (7,), "blocks.0.weight": (5, 3), "head.weight": (4, 3, 2)}


@pytest.mark.compile  # backend "eager": checks dynamo tracing and guards only (~2 s)
def test_compiled_step_traces_once_over_three_steps() -> None:
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(optim.warmup_cosine(1e-2, 1, 5), weight_decay=0.1, mask=r"weight$"),
    )

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    graphs = []

    def counting_backend(graph_module: torch.fx.GraphModule, example_inputs: list):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=counting_backend, fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    params = {path: torch.randn(shape, generator=generator) for path, shape in PARAMS.items()}
    eager_params, eager_state = params, opt.init(params)
    state = opt.init(params)
    try:
        for _ in range(3):
            grads = {
                path: torch.randn(shape, generator=generator) for path, shape in PARAMS.items()
            }
            params, state = compiled(params, state, grads)
            eager_params, eager_state = step(eager_params, eager_state, grads)
    finally:
        torch._dynamo.reset()

    assert len(graphs) == 1, f"traced {len(graphs)} graphs in 3 steps; the step recompiled"
    torch.testing.assert_close(params, eager_params, atol=0, rtol=0)
    torch.testing.assert_close(state, eager_state, atol=0, rtol=0)
    assert optim.get_state(state, "count").item() == 3


@pytest.mark.compile  # backend "eager": Dynamo tracing only (~1 s)
def test_layout_check_of_apply_updates_raises_under_compile() -> None:
    """The check compares paths, which Dynamo traces on every supported torch (2.11 stopped
    with an internal error on a ``PyTreeSpec`` comparison), and still names the paths."""
    params = {"a": torch.ones(1), "b": torch.ones(1)}
    torch._dynamo.reset()
    try:
        compiled = torch.compile(optim.apply_updates, backend="eager")
        with pytest.raises(OptimTreeMismatchError, match=r"missing=\['b'\].*unexpected=\['c'\]"):
            compiled(params, {"a": torch.ones(1), "c": torch.ones(1)})
    finally:
        torch._dynamo.reset()
