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


def _held_at_update(
    shard: str, pp: int = 1, vocab: int = 256, tp: int = 1, fsdp: int = 2
) -> tuple[dict[str, Any], Any]:
    others = {"pp": pp, "tp": tp}
    mesh = d9d.make_mesh("cpu", fsdp=fsdp, **{axis: n for axis, n in others.items() if n > 1})
    model = llama(vocab_size=vocab)()
    opt = _Measured(optimizer())
    step = train_step(model, opt)
    if pp > 1:
        step = d9d.pipeline(mesh, microbatches=2)(step)
    if tp > 1:
        step = d9d.tensor_parallel(mesh)(step)
    step = d9d.shard_params(mesh, "fsdp", shard=shard)(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    batch = step.shard_batch(batches(vocab, global_batch=12, steps=1)[0])  # 2 or 3 ranks
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


@pytest.mark.parametrize("shard", ["opt_state", "grads", "params"])
def test_bytes_held_at_the_update_of_uneven_shards_are_step_memory(shard: str) -> None:
    """Vocab 97 on fsdp=2: rank 1 keeps 48 of the 97 rows of the embedding and the head.
    ZeRO-1's grads are copies of a rank's own rows (``step.memory`` once counted rank 0's 49
    on rank 1 too: 512 B more than it holds); ZeRO-2's and ZeRO-3's are views of their
    reduce-scatter's chunk, padded to 49 rows on every rank (``step.memory`` once counted
    ZeRO-3's at 48: 512 B less)."""
    for seen, memory in run_on_ranks(_held_at_update, 2, shard, 1, 97):
        assert seen["held"] == memory.total, (seen, memory)
        assert seen["grads"] == memory.grads


@pytest.mark.parametrize("shard", ["params", "grads", "opt_state"])
@pytest.mark.parametrize(("fsdp", "vocab"), [(2, 256), (3, 98)], ids=["fsdp=2", "fsdp=3"])
def test_bytes_held_at_the_update_under_tensor_parallelism_are_step_memory(
    fsdp: int, vocab: int, shard: str
) -> None:
    """fsdp=2 x tp=2: a column-parallel weight's shard is ``Shard(1)`` on ``fsdp`` (``tp``
    shards dim 0). Its grad was copied out of the block's reduce-scatter output, which the
    row-parallel weights' grads (views of it) kept whole: 61,952 B more grads than
    ``step.memory`` under ZeRO-2 and ZeRO-3 (187,520 held, 125,568 counted). Now each rank's
    piece of the reduce-scatter is its shard in its own order, so every grad is a view of the
    output; a norm's grad, all-reduced over ``tp`` after it, is copied back into its rows.
    fsdp=3 splits the hidden size 64 unevenly: a ``Shard(1)`` grad is then a strided view of
    its padded chunk, as DTensor's own reduce-scatter leaves it, not a copy beside it."""
    for seen, memory in run_on_ranks(_held_at_update, 2 * fsdp, shard, 1, vocab, 2, fsdp):
        assert seen["held"] == memory.total, (seen, memory)
        assert seen["grads"] == memory.grads, (seen, memory)
        assert seen["other"] == 4, seen


def _held_in_stages() -> dict[str, tuple[dict[str, Any], Any]]:
    return {s: _held_at_update(s, pp=2) for s in ("params", "grads", "opt_state")}


def test_bytes_held_at_the_update_inside_pipeline_stages_are_step_memory() -> None:
    """pp=2 x fsdp=2 under 1F1B, 2 microbatches, a block a stage: the same, on each rank's stage,
    the grads accumulated over the microbatches freed once reduced; what else the step
    still holds (the schedule's buffers) is ZeRO-3's under ZeRO-1 and ZeRO-2."""
    for runs in run_on_ranks(_held_in_stages, 4, method="fork", timeout=300):
        zero3 = runs["params"][0]
        for shard, (seen, memory) in runs.items():
            assert seen["held"] == memory.total, (shard, seen, memory)
            assert seen["grads"] == memory.grads, shard
            assert seen["slices_share_the_stored"], shard
            assert seen["other"] == zero3["other"], (shard, seen, zero3)
