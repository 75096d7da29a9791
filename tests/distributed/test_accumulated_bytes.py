"""What a step that reduces its grads once a step holds when it reduces them, measured on
the storages alive at its first reduce collective, against ``step.memory``'s
``accumulated_grads`` and ``at_reduction``: under microbatch accumulation every param's
grad is held whole (unreduced) until then, under ZeRO-1, 2 and 3 alike."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from equivalence import batches, llama, optimizer, train_step
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import d9d
from d9d.testing import run_on_ranks

pytestmark = pytest.mark.distributed

_REDUCTIONS = {"reduce_scatter_tensor", "all_reduce"}


def _storages(*trees: Any) -> dict[int, int]:
    """{storage identity: bytes} of the local tensors of ``trees``, each storage once."""
    out = {}
    for leaf in d9d.tree.leaves(trees):
        if isinstance(leaf, torch.Tensor):
            storage = (leaf.to_local() if isinstance(leaf, DTensor) else leaf).untyped_storage()
            out[StorageWeakRef(storage).cdata] = storage.nbytes()
    return out


class _HeldAtReduction(TorchDispatchMode):
    """Records the bytes of the storages that ops returned and are still alive (those of
    ``inputs`` left out) when the first reduce collective of more than a few elements is
    issued: the grads' reduction (the loss's and token count's all-reduces are smaller)."""

    def __init__(self, inputs: Any) -> None:
        super().__init__()
        self.inputs = set(_storages(inputs))
        self.outputs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.held: int | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor lowers the op to local ops, seen here
        name = func.__name__.split(".")[0]
        if self.held is None and name in _REDUCTIONS and args[0].numel() > 64:
            self.held = sum(n for ref, n in self.outputs.values() if not ref.expired())
        out = func(*args, **(kwargs or {}))
        for leaf in out if isinstance(out, tuple | list) else (out,):
            if type(leaf) is torch.Tensor:
                ref = StorageWeakRef(leaf.untyped_storage())
                if ref.cdata not in self.inputs:
                    self.outputs[ref.cdata] = (ref, leaf.untyped_storage().nbytes())
        return out


class _HeldAfterLastBackward(_HeldAtReduction):
    """Also records the most bytes alive (storages ops returned, ``inputs`` left out) at any op
    from the end of the ``backwards``-th backward (the step's last microbatch's; an op runs
    in a backward while autograd's engine has a graph task) to the first grad reduction: the
    running sum of the grads and, where they are added after its backward returned them
    whole, that microbatch's grads."""

    def __init__(self, inputs: Any, backwards: int) -> None:
        super().__init__(inputs)
        self.backwards, self.ended, self.in_backward = backwards, 0, False
        self.after_last: int | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not any(issubclass(t, DTensor) for t in types):
            in_backward = torch._C._current_graph_task_id() != -1
            self.ended += self.in_backward and not in_backward
            self.in_backward = in_backward
            if self.ended == self.backwards and self.held is None:
                alive = sum(n for ref, n in self.outputs.values() if not ref.expired())
                self.after_last = max(self.after_last or 0, alive)
        return super().__torch_dispatch__(func, types, args, kwargs)


def _held_after_last_backward(
    shard: str, dtype: torch.dtype = torch.float32, **precision: torch.dtype
) -> tuple[int, Any]:
    mesh = d9d.make_mesh("cpu", fsdp=2)
    model = llama(dtype)()
    opt = optimizer()
    step = train_step(model, opt)
    step = d9d.shard_params(mesh, "fsdp", shard=shard, microbatches=2, **precision)(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    batch = step.shard_batch(batches(256, steps=1)[0])
    with _HeldAfterLastBackward((params, state, batch), backwards=2) as seen:
        step(params, state, batch)
    assert seen.after_last is not None and seen.held is not None
    return sum(_storages(params, state).values()) + seen.after_last, step.memory(params, state)


def _held_after_last_backward_per_shard(
    dtype: torch.dtype = torch.float32, **precision: torch.dtype
) -> dict[str, tuple[int, Any]]:
    shards = ("params", "grads", "opt_state")
    return {s: _held_after_last_backward(s, dtype, **precision) for s in shards}


def test_the_last_microbatch_adds_its_grads_into_the_sum_as_its_backward_makes_them() -> None:
    """fsdp=2, 2 microbatches, tiny Llama, float32, AdamW: from the end of the last
    microbatch's backward to the grads' reduction a rank holds its stored params, its
    optimizer state and one whole copy of the grads (each microbatch's grads are added into
    the running sum in place as its backward makes them): ``at_reduction`` and, of what the
    step made, only 0-d tensors, at most 32 B (the microbatches' losses, weighed losses and
    token counts while they are stacked and summed), under ZeRO-1, 2 and 3. Adding a
    microbatch's whole grads to the sum after its backward returned them held the model's
    500,992 B more (two copies)."""
    for runs in run_on_ranks(_held_after_last_backward_per_shard, 2):
        for shard, (held, memory) in runs.items():
            assert memory.widened_params == 0, (shard, memory)
            assert held == memory.at_reduction + 32, (shard, held, memory)


def test_bf16_params_summed_in_float32_hold_float32_copies_through_each_microbatch() -> None:
    """fsdp=2, 2 microbatches, bf16 params (``master_weights``' layout) reduced in float32:
    ``value_and_grad`` differentiates each param as a float32 copy of the step body's (its
    shard under ZeRO-1, 2 and 3), alive until the last microbatch's backward has returned,
    so from then to the reduction a rank holds ``at_reduction`` plus exactly
    ``widened_params`` (4 bytes an element of the step body's shards; ZeRO-1/2 store the
    params whole) and the 0-d losses. ``step.memory`` did not count the copies, and each
    microbatch's lived on through the next (a reference cycle of its ``apply`` call),
    twice ``widened_params``."""
    f32 = torch.float32
    for runs in run_on_ranks(
        _held_after_last_backward_per_shard, 2, torch.bfloat16, reduce_dtype=f32
    ):
        for shard, (held, memory) in runs.items():
            shards = memory.params if shard == "params" else memory.params // 2  # bf16
            assert memory.widened_params == 2 * shards, (shard, memory)
            assert held == memory.at_reduction + memory.widened_params + 32, (shard, held, memory)


def _held(shard: str, microbatches: int, **precision: torch.dtype) -> tuple[int, Any, int]:
    mesh = d9d.make_mesh("cpu", fsdp=2)
    model = llama()()
    opt = optimizer()
    step = train_step(model, opt)
    step = d9d.shard_params(mesh, "fsdp", shard=shard, microbatches=microbatches, **precision)(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    batch = step.shard_batch(batches(256, steps=1)[0])
    with _HeldAtReduction((params, state, batch)) as seen:
        step(params, state, batch)
    held = sum(_storages(params, state).values()) + seen.held
    whole = sum(p.numel() * p.element_size() for p in model.params.values())
    return held, step.memory(params, state), whole


def _held_per_shard(microbatches: int) -> dict[str, tuple[int, Any, int]]:
    return {s: _held(s, microbatches) for s in ("params", "grads", "opt_state")}


def test_whole_grads_held_at_the_reduction_under_accumulation_are_step_memory() -> None:
    """fsdp=2, 2 microbatches, tiny Llama, float32, AdamW: when the summed grads are reduced a
    rank holds its stored params, its optimizer state and every param's grad whole (the
    model's float32 bytes, ZeRO-3's too), exactly ``step.memory().at_reduction``, and nothing
    else the step made but the loss and its token count (one float32 each; the count goes on to
    ``Runtime.reduce_differentiated``): more than ``total`` (at the update) by
    the whole grads less the kept ones."""
    for runs in run_on_ranks(_held_per_shard, 2, 2):
        for shard, (held, memory, whole) in runs.items():
            assert memory.accumulated_grads == whole, (shard, memory)
            assert held == memory.at_reduction + 8, (shard, held, memory)
            assert memory.at_reduction - memory.total == whole - memory.grads, shard


def test_one_microbatch_accumulates_nothing() -> None:
    """fsdp=2, one microbatch: each block's grads are reduced as its backward ends, so no
    whole grads are accumulated and ``at_reduction`` is ``total``."""
    for runs in run_on_ranks(_held_per_shard, 2, 1):
        for shard, (_, memory, _) in runs.items():
            assert memory.accumulated_grads == 0, shard
            assert memory.at_reduction == memory.total, shard


def _held_in_stage(shard: str) -> tuple[int, Any, int]:
    mesh = d9d.make_mesh("cpu", pp=2, fsdp=2)
    model = llama()()
    opt = optimizer()
    step = d9d.pipeline(mesh, microbatches=2)(train_step(model, opt))
    step = d9d.shard_params(mesh, "fsdp", shard=shard)(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    batch = step.shard_batch(batches(256, steps=1)[0])
    with _HeldAtReduction((params, state, batch)) as seen:
        step(params, state, batch)
    held = sum(_storages(params, state).values()) + seen.held
    stage = sum(model.params[p].numel() * model.params[p].element_size() for p in params)
    return held, step.memory(params, state), stage


def _held_in_stages() -> dict[str, tuple[int, Any, int]]:
    return {s: _held_in_stage(s) for s in ("params", "grads", "opt_state")}


def test_a_pipeline_stage_holds_its_whole_grads_at_the_reduction() -> None:
    """pp=2 x fsdp=2 under 1F1B, 2 microbatches: each stage sums its params' grads whole over
    the microbatches (ZeRO-1, 2 and 3 alike), so ``accumulated_grads`` is the stage's float32
    bytes, and a rank holds at least ``at_reduction`` when they are reduced. It holds more:
    the coalesced reduction's buffer of the stage's grads, the schedule's buffers, and under
    ZeRO-3 the stage's gathered params (docs/sharding.md)."""
    for runs in run_on_ranks(_held_in_stages, 4, method="fork", timeout=300):
        for shard, (held, memory, stage) in runs.items():
            assert memory.accumulated_grads == stage, (shard, memory)
            assert held >= memory.at_reduction + stage, (shard, held, memory)


_MIXED = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


def _held_mixed() -> dict[str, tuple[int, Any, int]]:
    return {s: _held(s, 2, **_MIXED) for s in ("params", "grads")}


def test_accumulation_in_bf16_compute_holds_float32_sums() -> None:
    """fsdp=2, 2 microbatches, float32 params gathered and computed in bf16, grads reduced in
    float32: each microbatch's grads are cast to float32 as its backward makes them and
    summed so, and at the reduction a rank holds exactly ``at_reduction`` plus the loss and
    its token count, with
    ``accumulated_grads`` the model's elements in float32 (ZeRO-3 and ZeRO-2)."""
    for runs in run_on_ranks(_held_mixed, 2):
        for shard, (held, memory, whole) in runs.items():
            assert memory.accumulated_grads == whole, (shard, memory)
            assert held == memory.at_reduction + 8, (shard, held, memory)


class _SummedInBackward(_HeldAtReduction):
    """Also records, at the first grad reduction, ``{dtype: bytes}`` of the storages alive
    then that an earlier backward pass made (an op ran while autograd's engine had another
    graph task than the reduction's): the sums a pipeline stage's ``.grad`` accumulated
    over its microbatches, where the backward that reduces them is a pass of its own."""

    def __init__(self, inputs: Any) -> None:
        super().__init__(inputs)
        self.made: dict[int, tuple[StorageWeakRef, int, torch.dtype, int]] = {}
        self.summed: dict[torch.dtype, int] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        task = torch._C._current_graph_task_id()
        if self.held is None and func.__name__.split(".")[0] in _REDUCTIONS:
            self.summed = {}
            for ref, made_in, dtype, size in self.made.values():
                if not ref.expired() and made_in not in (-1, task):
                    self.summed[dtype] = self.summed.get(dtype, 0) + size
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for leaf in out if isinstance(out, tuple | list) else (out,):
            if type(leaf) is torch.Tensor:
                ref = StorageWeakRef(leaf.untyped_storage())
                known = self.made.get(ref.cdata)
                if known is None or known[0].expired():  # where it was made, not written
                    size = leaf.untyped_storage().nbytes()
                    self.made[ref.cdata] = (ref, task, leaf.dtype, size)
        return out


def _summed_in_stage() -> tuple[dict[torch.dtype, int], Any, int]:
    mesh = d9d.make_mesh("cpu", pp=2, fsdp=2)
    model = llama()()
    opt = optimizer()
    step = d9d.pipeline(mesh, microbatches=2)(train_step(model, opt))
    step = d9d.shard_params(mesh, "fsdp", **_MIXED)(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    batch = step.shard_batch(batches(256, steps=1)[0])
    with _SummedInBackward((params, state, batch)) as seen:
        step(params, state, batch)
    assert seen.summed is not None
    return seen.summed, step.memory(params, state), sum(model.params[p].numel() for p in params)


def test_a_pipeline_stage_sums_its_bf16_grads_in_float32() -> None:
    """pp=2 x fsdp=2 (ZeRO-3) under 1F1B, float32 params gathered and computed in bf16, grads
    reduced in float32, 2 microbatches: a stage moves each microbatch's bf16 grad of a weight
    into that weight's float32 sum as the backward puts it in ``.grad``, so what the
    schedule's backward passes made and is alive at the reduction is the stage's elements in
    float32 and nothing in bf16, exactly ``accumulated_grads`` (which counted them in bf16,
    half as many bytes, when ``.grad`` summed them)."""
    for summed, memory, elements in run_on_ranks(_summed_in_stage, 4, method="fork", timeout=300):
        assert summed == {torch.float32: 4 * elements}, (summed, elements)
        assert memory.accumulated_grads == 4 * elements, memory


def _made_in_backward_after_zbv_step() -> tuple[int, dict[torch.dtype, int]]:
    mesh = d9d.make_mesh("cpu", pp=2, fsdp=2)
    model = llama(n_layers=4)()  # a block per stage
    opt = optimizer()
    schedule = {"schedule": "zbv", "virtual_stages": 2, "microbatches": 2}
    step = d9d.pipeline(mesh, **schedule)(train_step(model, opt))
    step = d9d.shard_params(mesh, "fsdp", **_MIXED)(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    batch = step.shard_batch(batches(256, steps=1)[0])
    with _SummedInBackward((params, state, batch)) as seen:
        out = step(params, state, batch)
    returned = set(_storages(out))
    alive: dict[torch.dtype, int] = {}
    for ref, made_in, dtype, size in seen.made.values():
        if not ref.expired() and made_in != -1 and ref.cdata not in returned:
            alive[dtype] = alive.get(dtype, 0) + size
    return mesh.get_local_rank("pp"), alive


def test_a_zero_bubble_step_releases_the_grads_of_received_activations() -> None:
    """pp=2 x fsdp=2 under ZBV, bf16 compute, 2 microbatches: the input pass leaves each
    microbatch's grad on the activation its stage received, which torch clears when the next
    step starts; the step clears them as it ends, so nothing its backward made outlives it
    but, on the rank holding stages 1 and 2, the grads stage 2 hands stage 1 in place of
    torch's receive buffers (kept as those are). Without the clearing: 8,192 B of bf16 more
    on every rank."""
    microbatch_activation = 2 * 16 * 64 * 2  # rows x seq x dim, bf16
    for pp_rank, alive in run_on_ranks(_made_in_backward_after_zbv_step, 4, method="fork"):
        expected = {torch.bfloat16: 2 * microbatch_activation} if pp_rank == 1 else {}
        assert alive == expected, (pp_rank, alive)
