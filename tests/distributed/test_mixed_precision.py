"""``shard_params``' mixed precision against a one-device reference that does the same casts.

The reference computes each data-parallel rank's (and microbatch's) grads on one device in
the compute dtype, casts them to the reduce dtype and takes their mean there, then rounds
the mean to the stored params' dtype: what the docs say the sharded step does. Summing in
the compute dtype instead differs from it by bf16 roundings (3e-3 to 6e-3 of a param's
largest grad here), so each comparison is bit for bit.
"""

from __future__ import annotations

import copy
import functools
import threading

import pytest
import torch
from equivalence import batches, llama
from lone_manager import LoneManager
from torch.distributed import ReduceOp

import d9d
from d9d.testing import run_on_ranks

pytestmark = pytest.mark.distributed

BF16, F32 = torch.bfloat16, torch.float32


def _loss(model: d9d.Model, params: dict, batch: dict) -> torch.Tensor:
    return d9d.losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])


def _sharded_grads(
    model: d9d.Model,
    mesh_axes: dict[str, int],
    options: dict,
    batch: dict,
    manager: object | None = None,
    microbatches: int = 1,
) -> dict[str, torch.Tensor]:
    """The grads the step body gets under ``shard_params(mesh, "fsdp", **options)``, whole;
    with a ``manager``, under ``fault_tolerant(manager, microbatches=microbatches)`` too."""
    mesh = d9d.make_mesh("cpu", **mesh_axes)
    model = copy.deepcopy(model)

    def grads_step(params: dict, opt_state: tuple, batch: dict) -> tuple:
        return d9d.value_and_grad(lambda p, b: _loss(model, p, b))(params, batch)[1], opt_state, {}

    step = d9d.shard_params(mesh, "fsdp", **options)(grads_step)
    if manager is not None:
        step = d9d.fault_tolerant(manager, microbatches=microbatches)(step)
    params, _ = step.place(model.params, (), model=model)
    grads, _, _ = step(params, (), step.shard_batch(batch))
    return {k: g.full_tensor() for k, g in grads.items()}


def _reference(
    model: d9d.Model, batch: dict, parts: int, compute: torch.dtype, reduce: torch.dtype
) -> dict[str, torch.Tensor]:
    """The mean over ``parts`` equal slices of ``batch`` of each slice's grads computed in
    ``compute``, each cast to ``reduce`` and summed there, rounded to the params' dtypes."""
    rows = batch["tokens"].shape[0] // parts
    each = []
    for i in range(parts):
        part = {k: v[i * rows : (i + 1) * rows] for k, v in batch.items()}
        params = {k: v.detach().to(compute).requires_grad_() for k, v in model.params.items()}
        grads = torch.autograd.grad(_loss(model, params, part), list(params.values()))
        each.append([g.to(reduce) for g in grads])
    while len(each) > 1:  # in pairs, as the collectives (and microbatches, then ranks) add
        pairs = zip(each[::2], each[1::2], strict=True)
        each = [[a + b for a, b in zip(x, y, strict=True)] for x, y in pairs]
    return {
        k: (g / parts).to(v.dtype) for (k, v), g in zip(model.params.items(), each[0], strict=True)
    }


def _named(key: str, message: str) -> str:
    return f"{key}: {message}"


def _assert_equal(got: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor]) -> None:
    assert got.keys() == wanted.keys()
    for key in got:
        torch.testing.assert_close(
            got[key], wanted[key], rtol=0, atol=0, msg=functools.partial(_named, key)
        )


_MODEL = llama(F32, 1)()
_BF16_MODEL = llama(BF16, 1)()
_BATCH = batches(256, global_batch=8, seq_len=16, steps=1)[0]

LAYOUTS = {
    "fsdp=2": ({"fsdp": 2}, {}, 2),
    "dp=2 x fsdp=2": ({"dp": 2, "fsdp": 2}, {"replicate_axis": "dp"}, 4),
    "fsdp=2, ZeRO-2": ({"fsdp": 2}, {"shard": "grads"}, 2),
    "fsdp=2, ZeRO-1": ({"fsdp": 2}, {"shard": "opt_state"}, 2),
}


@pytest.mark.parametrize("reduce", [F32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float32_params_computed_in_bf16_reduce_in_the_reduce_dtype(
    layout: str, reduce: torch.dtype
) -> None:
    """float32 params, ``param_dtype=bf16``: the reduce-scatter (and HSDP's all-reduce over
    ``dp``, ZeRO-1's all-reduce) sums each rank's bf16 grad cast to ``reduce_dtype``."""
    mesh_axes, options, ranks = LAYOUTS[layout]
    options = {**options, "param_dtype": BF16, "reduce_dtype": reduce}
    got = run_on_ranks(_sharded_grads, ranks, _MODEL, mesh_axes, options, _BATCH)[0]
    _assert_equal(got, _reference(_MODEL, _BATCH, ranks, BF16, reduce))


@pytest.mark.parametrize("param_dtype", [None, BF16], ids=["no_cast", "bfloat16"])
@pytest.mark.parametrize("shard", ["params", "grads", "opt_state"])
def test_bf16_params_sum_microbatch_grads_in_the_reduce_dtype(
    shard: str, param_dtype: torch.dtype | None
) -> None:
    """bf16 params (``master_weights``' layout), ``reduce_dtype=float32``, 2 microbatches
    on fsdp=2: the 4 slices' bf16 grads are summed in float32 (over microbatches as over
    ranks) and rounded once to bf16. They were summed in bf16: autograd rounded each
    microbatch's float32 grad to the bf16 param it was for before it was added in."""
    options = {"shard": shard, "param_dtype": param_dtype, "reduce_dtype": F32, "microbatches": 2}
    got = run_on_ranks(_sharded_grads, 2, _BF16_MODEL, {"fsdp": 2}, options, _BATCH)[0]
    _assert_equal(got, _reference(_BF16_MODEL, _BATCH, 4, BF16, F32))


def _tp_all_reduce_bytes(reduce: torch.dtype) -> tuple[int, int]:
    """``(bytes all-reduced over tp in one step, elements of the norms' fsdp shards)`` on
    fsdp=2 x tp=2, bf16 compute: the forward's all-reduces of bf16 activations, and the
    norms' grads (``Partial`` sums over tp under sequence parallelism)."""
    mesh = d9d.make_mesh("cpu", fsdp=2, tp=2)
    model = copy.deepcopy(_MODEL)

    def step_fn(params: dict, opt_state: tuple, batch: dict) -> tuple:
        return d9d.value_and_grad(lambda p, b: _loss(model, p, b))(params, batch)[1], opt_state, {}

    step = d9d.shard_params(mesh, "fsdp", param_dtype=BF16, reduce_dtype=reduce)(step_fn)
    step = d9d.tensor_parallel(mesh, "tp")(step)
    params, _ = step.place(model.params, (), model=model)
    stats = step.comms(params, (), step.shard_batch(_BATCH))
    norms = [p.to_local().numel() for k, p in params.items() if k.endswith("norm.weight")]
    return stats.bytes[("all_reduce", "tp")], sum(norms)


def test_tp_sums_of_norm_grads_are_in_the_reduce_dtype() -> None:
    """fsdp=2 x tp=2: a norm's grad is reduce-scattered over fsdp and then all-reduced over
    tp in ``reduce_dtype``: float32 moves 2 bytes more per element of its shard than bf16,
    and nothing else all-reduced over tp changes."""
    wide, elements = run_on_ranks(_tp_all_reduce_bytes, 4, F32)[0]
    narrow, _ = run_on_ranks(_tp_all_reduce_bytes, 4, BF16)[0]
    assert elements == 3 * 64 // 2  # three norms of 64, each rank's half
    assert wide - narrow == elements * (F32.itemsize - BF16.itemsize)


@pytest.mark.parametrize("shard", ["grads", "opt_state"])
def test_fault_tolerant_microbatches_of_bf16_params_sum_in_the_reduce_dtype(shard: str) -> None:
    """As above under ZeRO-1/2 with ``fault_tolerant(manager, microbatches=2)``
    accumulating (a lone replica group), which reduces each microbatch inside the group as
    it comes: ZeRO's reduced grads were rounded to the bf16 params, and summed in bf16."""
    options = {"shard": shard, "reduce_dtype": F32}
    got = run_on_ranks(
        _sharded_grads, 2, _BF16_MODEL, {"fsdp": 2}, options, _BATCH, LoneManager([True] * 2), 2
    )[0]
    _assert_equal(got, _reference(_BF16_MODEL, _BATCH, 4, BF16, F32))


def _widened_bytes(reduce: torch.dtype | None, fault_tolerant: bool) -> tuple[int, int]:
    """``step.memory``'s ``widened_params`` and ``params`` on fsdp=2 (one microbatch)."""
    mesh = d9d.make_mesh("cpu", fsdp=2)
    model = copy.deepcopy(_BF16_MODEL)

    def grads_step(params: dict, opt_state: tuple, batch: dict) -> tuple:
        return d9d.value_and_grad(lambda p, b: _loss(model, p, b))(params, batch)[1], opt_state, {}

    step = d9d.shard_params(mesh, "fsdp", reduce_dtype=reduce)(grads_step)
    if fault_tolerant:
        step = d9d.fault_tolerant(LoneManager([True]))(step)
    params, _ = step.place(model.params, (), model=model)
    memory = step.memory(params, ())
    return memory.widened_params, memory.params


def test_fault_tolerant_counts_its_float32_copies_of_bf16_params_in_step_memory() -> None:
    """Under ``fault_tolerant`` (one microbatch) a bf16 param reduced in float32 is
    differentiated as a float32 copy of this rank's shard, as under microbatches: 4 bytes
    an element, twice the bf16 shard's, in ``widened_params``; none without the transform or
    in the param's own reduce dtype. They were not counted."""
    for fault_tolerant, reduce in [(True, F32), (False, F32), (True, None)]:
        widened, params = run_on_ranks(_widened_bytes, 2, reduce, fault_tolerant)[0]
        wanted = 2 * params if fault_tolerant and reduce == F32 else 0
        assert widened == wanted, (fault_tolerant, reduce, widened, params)


class _Groups:
    """The managers of two replica groups run as threads: each all-reduce sums both groups'
    buffers in their dtype; every step commits."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.given: list[torch.Tensor | None] = [None, None]
        self.reduced: list[tuple[torch.dtype, int]] = []

    def manager(self, group: int) -> LoneManager:
        groups, manager = self, LoneManager([True])

        def allreduce(tensor: torch.Tensor, reduce_op: ReduceOp) -> LoneManager:
            assert reduce_op == ReduceOp.SUM
            groups.reduced.append((tensor.dtype, tensor.numel()))
            groups.given[group] = tensor.clone()
            groups.barrier.wait()
            tensor.copy_(groups.given[0] + groups.given[1])
            groups.barrier.wait()
            return manager

        manager.allreduce = allreduce
        manager.num_participants = lambda: 2
        return manager


def test_two_fault_tolerant_groups_sum_bf16_grads_over_microbatches_and_groups_in_float32():
    """bf16 params, ``reduce_dtype=float32``, two replica groups (threads) of 2 microbatches
    each: the 4 slices' grads are summed in float32, over each group's microbatches and then
    over the groups in one float32 all-reduce, and rounded once to bf16. Both sums were bf16
    ones (0.6% of a param's largest grad off here)."""
    groups, got = _Groups(), [None, None]
    halves = [{k: v[4 * g : 4 * g + 4] for k, v in _BATCH.items()} for g in range(2)]

    def run(g: int) -> None:
        options = {"reduce_dtype": F32}
        got[g] = _sharded_grads(_BF16_MODEL, {"fsdp": 1}, options, halves[g], groups.manager(g), 2)

    threads = [threading.Thread(target=run, args=(g,)) for g in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    numel = sum(v.numel() for v in _BF16_MODEL.params.values())
    assert groups.reduced == [(F32, numel + 2)] * 2  # the grads, the loss sum and the count
    wanted = _reference(_BF16_MODEL, _BATCH, 4, BF16, F32)
    for grads in got:
        _assert_equal(grads, wanted)
    narrow = _reference(_BF16_MODEL, _BATCH, 4, BF16, BF16)
    assert not any(torch.equal(got[0][k], narrow[k]) for k in narrow)


def _pipelined_grads(manager: LoneManager | None) -> dict[str, torch.Tensor]:
    """The grads of this rank's stages under ``pipeline(pp=2)`` of the bf16 model, reduced
    in float32, with uneven valid tokens; under ``fault_tolerant(manager)`` with one."""
    mesh = d9d.make_mesh("cpu", pp=2, dp=1)
    model = llama(BF16, 2)()
    batch = dict(_BATCH)
    batch["labels"] = batch["labels"].clone()
    batch["labels"][0, 5:] = -100

    def grads_step(params: dict, opt_state: tuple, batch: dict) -> tuple:
        return d9d.value_and_grad(lambda p, b: _loss(model, p, b))(params, batch)[1], opt_state, {}

    step = d9d.pipeline(mesh, microbatches=2)(grads_step)
    step = d9d.shard_params(mesh, None, replicate_axis="dp", reduce_dtype=F32)(step)
    if manager is not None:
        step = d9d.fault_tolerant(manager)(step)
    params, _ = step.place(model.params, (), model=model)
    grads, _, _ = step(params, (), step.shard_batch(batch))
    return {k: g.full_tensor() for k, g in grads.items()}


def _lone_pipelined_group() -> tuple[dict, dict, list[str]]:
    torch.manual_seed(0)
    plain = _pipelined_grads(None)
    manager = LoneManager([True])
    torch.manual_seed(0)
    return plain, _pipelined_grads(manager), manager.calls


def test_a_lone_pipelined_fault_tolerant_group_of_bf16_params_equals_the_pipeline():
    """pp=2, bf16 params reduced in float32, one replica group: ``fault_tolerant`` after the
    executor multiplies each stage's bf16 mean grads by the group's token count, all-reduces
    and divides them in float32 and rounds once, giving back the pipeline's grads bit for
    bit. In bf16 the product and the quotient rounded (0.5% of a param's largest grad off)."""
    for plain, got, calls in run_on_ranks(_lone_pipelined_group, 2, method="fork"):
        _assert_equal(got, plain)
        numel = sum(g.numel() for g in got.values())
        assert calls == ["start_quorum", f"allreduce torch.float32 {numel + 2}", "should_commit"]


def _pipelined_group(model: d9d.Model, half: int, partner: list | None) -> tuple:
    """``(grads, carried, memory)`` of replica group ``half`` (its half of the batch) under
    ``pipeline(pp=2)`` of the bf16 ``model`` reduced in float32 and ``fault_tolerant``: this
    rank's stages' grads, copies of what each of its all-reduces over the groups carried, and
    ``step.memory``'s ``(widened_params, params)``.
    Alone when ``partner`` is None; else one of two groups, the other's rank carrying
    ``partner[rank]`` (as it carried when alone: its step does not depend on this one's)."""
    manager = LoneManager([True])
    if partner is not None:
        given = iter(partner[torch.distributed.get_rank()])

        def allreduce(tensor: torch.Tensor, reduce_op: ReduceOp) -> LoneManager:
            assert reduce_op == ReduceOp.SUM
            tensor.add_(next(given))
            return manager

        manager.allreduce = allreduce
        manager.num_participants = lambda: 2
    mesh = d9d.make_mesh("cpu", pp=2, dp=1)
    model = copy.deepcopy(model)

    def grads_step(params: dict, opt_state: tuple, batch: dict) -> tuple:
        return d9d.value_and_grad(lambda p, b: _loss(model, p, b))(params, batch)[1], opt_state, {}

    step = d9d.pipeline(mesh, microbatches=2)(grads_step)
    step = d9d.shard_params(mesh, None, replicate_axis="dp", reduce_dtype=F32)(step)
    step = d9d.fault_tolerant(manager)(step)
    params, _ = step.place(model.params, (), model=model)
    batch = {k: v[4 * half : 4 * half + 4] for k, v in _BATCH.items()}
    memory = step.memory(params, ())
    grads, _, _ = step(params, (), step.shard_batch(batch))
    grads = {k: g.full_tensor() for k, g in grads.items()}
    return grads, manager.reduced, (memory.widened_params, memory.params)


def test_two_pipelined_fault_tolerant_groups_of_bf16_params_round_their_grads_once():
    """bf16 params, ``reduce_dtype=float32``, two replica groups of pp=2 with 2 microbatches
    each (every microbatch 32 valid tokens): the 4 slices' grads are summed in float32, over
    each group's microbatches by the pipeline and over the groups, and rounded once to bf16.
    The pipeline handed each group's mean rounded to bf16, which the average rounded again.
    Each group runs twice (fork ranks): alone, recording what it carries, then with the
    other's record added in, as the all-reduce of two live groups would. ``step.memory``
    counts the float32 copies the stages differentiate (4 bytes an element of the bf16
    params); they were not counted under a pipeline."""
    model = llama(BF16, 2)()
    alone = [run_on_ranks(_pipelined_group, 2, model, g, None, method="fork") for g in range(2)]
    carried = [[reduced for _, reduced, _ in ranks] for ranks in alone]
    wanted = _reference(model, _BATCH, 4, BF16, F32)
    for half in range(2):
        got = run_on_ranks(_pipelined_group, 2, model, half, carried[1 - half], method="fork")
        merged = {k: g for grads, _, _ in got for k, g in grads.items()}
        _assert_equal(merged, wanted)
        for _, _, (widened, params) in got:
            assert widened == 2 * params > 0, (widened, params)
