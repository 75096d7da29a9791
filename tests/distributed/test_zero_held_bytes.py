"""What a ZeRO step really holds when its body updates, measured on the storages alive then,
against ``step.memory``: the body's param slices are views of the stored params, and
ZeRO-1 keeps only its slice of each reduced grad."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from equivalence import batches, llama, optimizer, train_step
from torch.distributed.tensor import DTensor

import d9d
from d9d.testing import KeptBytes, run_on_ranks

pytestmark = pytest.mark.distributed


def _storages(*trees: Any) -> dict[int, int]:
    """{storage address: bytes} of the local tensors of ``trees``, each storage once."""
    out = {}
    for leaf in d9d.tree.leaves(trees):
        if isinstance(leaf, torch.Tensor):
            local = leaf.to_local() if isinstance(leaf, DTensor) else leaf
            storage = local.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


class _Measured:
    """``inner`` whose first update records what is alive when it starts: the storages of
    the stored params, the body's params, grads and state, and any other storage the
    step made and still holds (:class:`KeptBytes`, which skips the step's inputs)."""

    def __init__(self, inner: d9d.optim.GradientTransformation) -> None:
        self.inner = inner
        self.stored: Any = None
        self.kept: KeptBytes | None = None
        self.seen: dict[str, Any] = {}

    def init(self, params: Any) -> Any:
        return self.inner.init(params)

    def update(self, grads: Any, state: Any, params: Any) -> Any:
        if self.kept is not None and not self.seen:
            held = _storages(self.stored, params, grads, state)
            named = _storages(grads)
            self.seen = {
                "held": sum(held.values()),
                "grads": sum(named.values()),
                "slices_share_the_stored": set(_storages(params)) <= set(_storages(self.stored)),
                # made by the step, still alive, and not a grad
                "other": self.kept.alive(skip=set(named)),
            }
        return self.inner.update(grads, state, params)


def _held_at_update(shard: str) -> tuple[dict[str, Any], Any]:
    mesh = d9d.make_mesh("cpu", fsdp=2)
    model = llama()()
    opt = _Measured(optimizer())
    step = d9d.shard_params(mesh, shard=shard)(train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params))
    batch = step.shard_batch(batches(256, steps=1)[0])
    opt.stored = params
    with KeptBytes(exclude=(params, state)) as kept:
        opt.kept = kept
        step(params, state, batch)
    return opt.seen, step.memory(params, state)


@pytest.mark.parametrize("shard", ["opt_state", "grads", "params"])
def test_bytes_held_at_the_update_are_step_memory(shard: str) -> None:
    """fsdp=2, tiny Llama, float32, AdamW: at the update a rank holds its stored params (the
    body's slices are views of them: ZeRO-1/2 hold no Ψ/N copy), the grads laid out as the
    update sees them (ZeRO-1's slices of its all-reduced grads, the whole ones freed per
    block) and the state, exactly ``step.memory().total``; nothing else the step made is
    alive but the loss (one float32). ZeRO-3 (``"params"``) as the control."""
    for seen, memory in run_on_ranks(_held_at_update, 2, shard):
        assert seen["held"] == memory.total, (seen, memory)
        assert seen["grads"] == memory.grads
        assert seen["slices_share_the_stored"]
        assert seen["other"] == 4, seen
