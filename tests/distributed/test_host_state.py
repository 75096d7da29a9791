"""``shard_params(opt_state_device="cpu")`` with ``d9d.optim.offloaded``: the optimizer
state kept on the host, updated there, equal bitwise to the update on the device.

On this CPU machine the host is the mesh's device, so the copies return their inputs; what
these tests pin down is everything else the GPU path runs: the state placed by the plan on
its device, the update run on plain shards by the wrapped optimizer and laid back out, its
bytes counted apart, its checkpoints, and the refusals."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import pytest
import torch
from equivalence import batches, llama, reference, train_step
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

import d9d
from d9d.errors import RankFailedError
from d9d.models import Llama, LlamaConfig
from d9d.testing import fake_world, run_on_ranks
from d9d.transforms import ParamPlan, Phase, Transform

pytestmark = pytest.mark.distributed

STEPS = 4
SHARDS = {"zero3": "params", "zero2": "grads", "zero1": "opt_state"}


def _optimizer(host: bool) -> d9d.optim.GradientTransformation:
    adamw = d9d.optim.adamw(d9d.optim.warmup_cosine(1e-2, 1, 10, init_value=1e-3), weight_decay=0.1)
    inner = d9d.optim.offloaded(adamw) if host else adamw
    return d9d.optim.chain(d9d.optim.clip_by_global_norm(0.5), inner)


def _placed(mesh, shard: str, host: bool):
    model = llama(torch.float32)()
    opt = _optimizer(host)
    device = "cpu" if host else None
    names = mesh.mesh_dim_names
    replicate = "dp" if "dp" in names else None
    transform = d9d.shard_params(mesh, "fsdp", replicate, shard=shard, opt_state_device=device)
    step = transform(train_step(model, opt))
    if "tp" in names:
        step = d9d.tensor_parallel(mesh)(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    return model, step, params, state


def _run(step, params, state, data):
    losses = []
    for batch in data:
        params, state, metrics = step(params, state, step.shard_batch(batch))
        losses.append(metrics["loss"])
    return torch.stack(losses), params, state


def _locals(tree):
    return [
        leaf.to_local() if isinstance(leaf, DTensor) else leaf for leaf in d9d.tree.leaves(tree)
    ]


def _equal_rank(shard: str, axes: dict[str, int] | None = None):
    mesh = d9d.make_mesh("cpu", **(axes or {"fsdp": 2}))
    data = batches(256, steps=STEPS)
    _, device_step, params, state = _placed(mesh, shard, host=False)
    device_memory = device_step.memory(params, state)
    device_losses, device_params, device_state = _run(device_step, params, state, data)
    model, host_step, params, state = _placed(mesh, shard, host=True)
    entry = host_step.plan.entries["layers.0.attn.wq.weight"]
    assert entry.state_device == "cpu"
    for leaf in _locals(state):
        assert leaf.device.type == "cpu"
    host_memory = host_step.memory(params, state)
    host_losses, host_params, host_state = _run(host_step, params, state, data)
    assert torch.equal(host_losses, device_losses)
    for a, b in zip(_locals(host_params), _locals(device_params), strict=True):
        assert torch.equal(a, b)
    # chain(clip, offloaded(adamw)) -> (clip's, OffloadedState(adamw's)); chain(clip, adamw).
    host_inner = d9d.tree.leaves(host_state[1].inner_state)
    device_inner = d9d.tree.leaves(device_state[1])
    for a, b in zip(host_inner, device_inner, strict=True):
        assert type(a) is type(b)
        a, b = (x.to_local() if isinstance(x, DTensor) else x for x in (a, b))
        assert torch.equal(a, b)
    elements = sum(p.numel() for p in model.params.values())
    scalars = d9d.tree.leaves(_optimizer(False).init(model.params))
    scalar_bytes = sum(x.element_size() for x in scalars if x.ndim == 0)
    return host_memory, device_memory, elements, scalar_bytes


@pytest.mark.parametrize("zero", list(SHARDS))
def test_host_update_equals_device_update_bitwise(zero: str) -> None:
    """4 AdamW steps (after global-norm clipping) on fsdp=2, float32: losses, params and
    state equal bitwise; the state's bytes are on the host, none on the device."""
    for host, device, elements, scalar_bytes in run_on_ranks(_equal_rank, 2, SHARDS[zero]):
        # AdamW's two float32 moments of this rank's half of every param (the tiny Llama's
        # dims split evenly in two), and its 0-d step counts and learning rate.
        state_bytes = 2 * 4 * elements // 2 + scalar_bytes
        assert (host.opt_state, host.host_opt_state) == (0, state_bytes)
        assert (device.opt_state, device.host_opt_state) == (state_bytes, 0)
        assert (host.params, host.grads) == (device.params, device.grads)
        assert host.total == device.total - state_bytes
        assert "optimizer state on the host" in str(host)


@pytest.mark.parametrize(
    ("zero", "axes"),
    [("zero3", {"dp": 2, "fsdp": 2}), ("zero2", {"fsdp": 2, "tp": 2})],
    ids=["dp=2 x fsdp=2, zero3", "fsdp=2 x tp=2, zero2"],
)
def test_host_update_equals_device_update_bitwise_on_wider_meshes(
    zero: str, axes: dict[str, int]
) -> None:
    """The state replicated over dp, and sharded over fsdp on the dim tp leaves whole (wq's
    ``(fsdp: Shard(1), tp: Shard(0))`` under ZeRO-2): cut on the host as DTensor cuts it."""
    for host, device, _, _ in run_on_ranks(_equal_rank, 4, SHARDS[zero], axes):
        assert host.host_opt_state == device.opt_state > 0 and host.opt_state == 0


def _resume_rank(directory: str):
    mesh = d9d.make_mesh("cpu", fsdp=2)
    data = batches(256, steps=STEPS)
    _, step, params, state = _placed(mesh, "params", host=True)
    losses, straight, _ = _run(step, params, state, data)
    _, step, params, state = _placed(mesh, "params", host=True)
    first, params, state = _run(step, params, state, data[:2])
    d9d.checkpoint.save(directory, {"params": params, "opt_state": state}, step=2).wait()
    _, step, target_params, target_state = _placed(mesh, "params", host=True)
    restored = d9d.checkpoint.restore(
        d9d.checkpoint.latest(directory), {"params": target_params, "opt_state": target_state}
    )
    for leaf in _locals(restored["opt_state"]):
        assert leaf.device.type == "cpu"
    rest, resumed, _ = _run(step, restored["params"], restored["opt_state"], data[2:])
    assert torch.equal(torch.cat([first, rest]), losses)
    for a, b in zip(_locals(resumed), _locals(straight), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_restores_host_state_and_continues_as_uninterrupted(tmp_path) -> None:
    """Save after 2 of 4 steps, restore onto a fresh placement, run 2 more: bitwise the run
    that never stopped."""
    run_on_ranks(_resume_rank, 2, str(tmp_path / "ckpt"))


def _refusal_rank(case: str):
    mesh = d9d.make_mesh("cpu", fsdp=2)
    model = llama(torch.float32)()
    opt = _optimizer(host=case != "plain optimizer")
    step = d9d.shard_params(mesh, "fsdp", opt_state_device="cpu")(train_step(model, opt))
    if case == "jit":
        step = d9d.jit(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    batch = step.shard_batch(batches(256, steps=1)[0])
    step(params, state, batch)


@pytest.mark.parametrize(
    ("case", "match"),
    [
        (
            "plain optimizer",
            r"shard_params\(opt_state_device='cpu'\) keeps .*wrap its elementwise part in "
            r"d9d.optim.offloaded",
        ),
        ("jit", r"shard_params\(opt_state_device='cpu'\) runs eagerly"),
    ],
)
def test_refusals(case: str, match: str) -> None:
    with pytest.raises(RankFailedError, match="PlanError: " + match):
        run_on_ranks(_refusal_rank, 2, case)


PIPELINES = {
    "1f1b": {"schedule": "1f1b", "microbatches": 2},
    "zbv": {"schedule": "zbv", "microbatches": 4, "virtual_stages": 2},
}


@functools.cache
def _reference():
    return reference(llama(torch.float64, 4), batches(256))


def _pipeline_rank(shard: str, schedule: str):
    """5 steps on pp=2 x fsdp=2 in float64, the state on the host and on the device: each
    run's losses, this rank's params and state (local), ``step.memory``, and the elements of
    the params this rank's stages hold."""
    runs = {}
    for host in (True, False):
        mesh = d9d.make_mesh("cpu", pp=2, fsdp=2)
        model, opt = llama(torch.float64, 4)(), _optimizer(host)
        step = d9d.pipeline(mesh, **PIPELINES[schedule])(train_step(model, opt))
        device = "cpu" if host else None
        step = d9d.shard_params(mesh, "fsdp", shard=shard, opt_state_device=device)(step)
        params, state = step.place(model.params, opt.init(model.params), model=model)
        assert {step.plan.entries[p].state_device for p in params} == {device}
        memory = step.memory(params, state)
        losses, params, state = _run(step, params, state, batches(256))
        inner = state[1].inner_state if host else state[1]
        held = sum(model.params[p].numel() for p in params)
        whole = {p: v.full_tensor() for p, v in params.items()}
        runs[host] = (losses, _locals(params), _locals(inner), memory, held, whole)
    return runs


@pytest.mark.parametrize(
    ("zero", "schedule"), [("zero3", "1f1b"), ("zero2", "1f1b"), ("zero1", "zbv")]
)
def test_pipeline_host_update_equals_device_update_bitwise_and_one_device(
    zero: str, schedule: str
) -> None:
    """pp=2 x fsdp=2, float64, 5 AdamW steps after global-norm clipping (zbv: two stages a
    rank): each stage's state on the host gives the losses, params and state of the state on
    the device bit for bit, and one device's fed the whole batch (rel 1e-9); the state's
    bytes are on the host, exactly AdamW's two moments of the rank's stages over fsdp and
    the counters, none on the device."""
    ref_losses, ref_params = _reference()
    counters = sum(x.element_size() for x in d9d.tree.leaves(_optimizer(False).init({})))
    ranks = run_on_ranks(_pipeline_rank, 4, SHARDS[zero], schedule, method="fork", timeout=300)
    for runs in ranks:
        (losses, params, inner, host, held, whole), device = runs[True], runs[False]
        assert torch.equal(losses, device[0])
        for a, b in zip([*params, *inner], [*device[1], *device[2]], strict=True):
            assert torch.equal(a, b)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-9, atol=1e-12)
        for path, value in whole.items():
            torch.testing.assert_close(value, ref_params[path], rtol=1e-9, atol=1e-12)
        assert (host.opt_state, host.host_opt_state) == (0, 2 * 8 * held // 2 + counters)
        assert host.host_opt_state == device[3].opt_state
        assert (host.params, host.grads) == (device[3].params, device[3].grads)


def test_refuses_an_unknown_device() -> None:
    def rank():
        d9d.shard_params(d9d.make_mesh("cpu", fsdp=2), opt_state_device="disk")

    with pytest.raises(RankFailedError, match=r"PlanError: .*opt_state_device='disk'; pass 'cpu'"):
        run_on_ranks(rank, 2)


def test_memory_on_a_cuda_mesh_counts_the_host_state_apart() -> None:
    """What ``d9d plan`` places (meta leaves on simulated ranks), on a mesh typed ``cuda``:
    the state's bytes on the host, exactly, none on the device."""
    n = LlamaConfig.tiny().num_params
    try:
        with fake_world(2):
            mesh = d9d.make_mesh("cuda", fsdp=2)
            model = d9d.functionalize(Llama(LlamaConfig.tiny(), device="meta"))
            opt = _optimizer(host=True)
            transform = d9d.shard_params(mesh, "fsdp", opt_state_device="cpu")
            step = transform(lambda p, s, b: (p, s, {}))
            memory = step.memory(*step.place(model.params, opt.init(model.params), model=model))
    finally:
        _clear_sharding_prop_cache()
    # float32: 4 bytes a param and a grad, AdamW's 8 of state, over two ranks; the counters
    # (adam's and the schedule's int64, the learning rate's float32) on the host too.
    assert (memory.params, memory.grads, memory.opt_state) == (4 * n // 2, 4 * n // 2, 0)
    assert memory.host_opt_state == 8 * n // 2 + 8 + 8 + 4


@dataclass(frozen=True)
class _StateOnHost(Transform):
    """Keeps the state of the params matching ``pattern`` on the host (a transform of this
    test's own: ``shard_params`` keeps every param's there)."""

    name: ClassVar[str] = "state_on_host"
    phase: ClassVar[Phase] = Phase.COMPUTE_FORM
    mesh: Any
    pattern: str

    def claimed_axes(self) -> tuple[str, ...]:
        return ()

    def rewrite(self, entry: ParamPlan) -> ParamPlan:
        return replace(entry, state_device="cpu") if re.search(self.pattern, entry.path) else entry


def _two_devices_rank():
    mesh = d9d.make_mesh("cpu", fsdp=2)
    model, opt = llama()(), _optimizer(host=True)
    step = _StateOnHost(mesh, r"^layers\.0\.")(d9d.shard_params(mesh)(train_step(model, opt)))
    step.place(model.params, opt.init(model.params), model=model)


def test_state_on_two_devices_is_refused() -> None:
    with pytest.raises(RankFailedError, match=r"keeps optimizer state on several devices"):
        run_on_ranks(_two_devices_rank, 2)
