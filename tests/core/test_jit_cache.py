"""A restarted run finds the graph ``d9d.jit`` compiled in inductor's cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import d9d


def _compile_once() -> dict:
    """One jitted ``shard_params`` step over a one-rank mesh (its DTensors' mesh enters the
    graph as an opaque input): its inductor counters, loss and new params."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = d9d.functionalize(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)))
    opt = d9d.optim.sgd(0.1)
    mesh = d9d.make_mesh("cpu", fsdp=1)

    @d9d.jit
    @d9d.shard_params(mesh, axis="fsdp")
    def step(params, opt_state, batch):
        def loss_fn(params, batch):
            return (model.apply(params, batch["x"]) - batch["y"]).square().mean()

        loss, grads = d9d.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return d9d.optim.apply_updates(params, updates), opt_state, {"loss": loss}

    params, state = step.place(model.params, opt.init(model.params), model=model)
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 4)}
    params, state, metrics = step(params, state, batch)
    return {
        "counters": dict(counters["inductor"]),
        "loss": metrics["loss"].item(),
        "params": {k: v.full_tensor().flatten().tolist() for k, v in params.items()},
    }


def _run_fresh(cache: Path, hash_seed: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.compile
def test_a_restarted_process_finds_the_compiled_graph_in_inductors_cache(tmp_path: Path) -> None:
    """Python salts ``hash()`` per process (two seeds here, as two restarts draw); the mesh
    used to carry its salted hash into the cache key (d9d/core/_mesh_hash.py)."""
    cold = _run_fresh(tmp_path, hash_seed="1")
    warm = _run_fresh(tmp_path, hash_seed="2")
    assert cold["counters"].get("fxgraph_cache_miss", 0) >= 1, cold["counters"]
    assert warm["counters"].get("fxgraph_cache_hit", 0) >= 1, warm["counters"]
    assert warm["counters"].get("fxgraph_cache_miss", 0) == 0, warm["counters"]
    assert warm["loss"] == cold["loss"] and warm["params"] == cold["params"]


if __name__ == "__main__":
    print(json.dumps(_compile_once()))
