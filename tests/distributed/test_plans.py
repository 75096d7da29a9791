"""Plans, communication volume, memory, and errors of ``make_mesh`` and ``shard_params``."""

from __future__ import annotations

import copy
import math
import pickle
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

import d9d
import d9d.core._apply
import d9d.core._gather
from d9d.cli._train_step import make_train_step
from d9d.core._comm_count import CollectiveCounter
from d9d.errors import IndivisibleError, MeshError, PlanError
from d9d.models import Llama, LlamaConfig
from d9d.testing import fake_world, run_on_ranks
from d9d.transforms.shard_params import _prefetch as shard_prefetch
from d9d.transforms.shard_params import _regather as shard_regather
from d9d.transforms.shard_params import _runtime as shard_runtime

pytestmark = pytest.mark.distributed


def _tiny(n_layers: int = 2) -> d9d.Model:
    return d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=n_layers)))


def _opt() -> d9d.optim.GradientTransformation:
    return d9d.optim.chain(d9d.optim.clip_by_global_norm(1.0), d9d.optim.adamw(1e-3))


def _batch() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def _comms(mesh_axes: dict[str, int], transform_kwargs: dict) -> list:
    def rank() -> d9d.transforms.CommStats:
        mesh = d9d.make_mesh("cpu", **mesh_axes)
        model, opt = _tiny(), _opt()
        step = d9d.shard_params(mesh, **transform_kwargs)(make_train_step(model, opt))
        params, state = step.place(model.params, opt.init(model.params))
        return step.comms(params, state, _batch())

    return run_on_ranks(rank, math.prod(mesh_axes.values()))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_step_moves_the_analytic_bytes(n: int, reshard: bool) -> None:
    params = _tiny().params
    model_bytes = sum(p.numel() * p.element_size() for p in params.values())
    # The backward needs every gathered param again except the embedding table (its grad
    # needs only the token ids), so resharding gathers all but that one a second time.
    regathered = model_bytes - params["embed.weight"].numel() * 4
    # One collective per unit, as FSDP2: the params outside blocks, then each of the 2 blocks.
    units = 1 + 2
    for stats in _comms({"fsdp": n}, {"reshard_after_forward": reshard}):
        assert stats.count[("all_gather", "fsdp")] == units * (1 + reshard)
        assert stats.bytes[("all_gather", "fsdp")] == model_bytes + regathered * reshard
        assert stats.count[("reduce_scatter", "fsdp")] == units
        assert stats.bytes[("reduce_scatter", "fsdp")] == model_bytes
        # The global grad norm (one fp32 per param, reduced once), the mean loss, and the
        # loss's count of valid tokens (one int64).
        assert stats.count[("all_reduce", "fsdp")] == 3
        assert stats.bytes[("all_reduce", "fsdp")] == 4 * len(params) + 4 + 8
        assert set(stats.count) == {
            ("all_gather", "fsdp"),
            ("reduce_scatter", "fsdp"),
            ("all_reduce", "fsdp"),
        }


def test_hsdp_adds_one_all_reduce_of_the_grad_shards_over_dp_per_unit() -> None:
    params = _tiny().params
    model_bytes = sum(p.numel() * p.element_size() for p in params.values())
    for stats in _comms({"dp": 2, "fsdp": 2}, {"replicate_axis": "dp"}):
        assert stats.count[("reduce_scatter", "fsdp")] == 1 + 2  # one per unit
        assert stats.bytes[("reduce_scatter", "fsdp")] == model_bytes
        # One all-reduce of a unit's grad shards (half the model in all) per unit, as
        # FSDP2 reduces a param group, the mean loss and the token count.
        assert stats.count[("all_reduce", "dp")] == 1 + 2 + 2
        assert stats.bytes[("all_reduce", "dp")] == model_bytes // 2 + 4 + 8


def test_ddp_all_reduces_each_grad_once() -> None:
    params = _tiny().params
    model_bytes = sum(p.numel() * p.element_size() for p in params.values())
    for stats in _comms({"dp": 2}, {"axis": None, "replicate_axis": "dp"}):
        # Each grad, the mean loss and the loss's count of valid tokens (int64).
        assert dict(stats.count) == {("all_reduce", "dp"): len(params) + 2}
        assert stats.bytes[("all_reduce", "dp")] == model_bytes + 4 + 8


ONE_RANK_AXES = {
    "fsdp=1": ({"fsdp": 1}, {}),
    "dp=2 x fsdp=1": ({"dp": 2, "fsdp": 1}, {"replicate_axis": "dp"}),
    "dp=1 x fsdp=2": ({"dp": 1, "fsdp": 2}, {"replicate_axis": "dp"}),
    "dp=2 x fsdp=1, ZeRO-2": ({"dp": 2, "fsdp": 1}, {"replicate_axis": "dp", "shard": "grads"}),
}


@pytest.mark.parametrize("layout", list(ONE_RANK_AXES))
def test_an_axis_of_one_rank_issues_no_collective(layout: str) -> None:
    """Over a one-rank axis nothing moves: ``shard_params``' own all-gathers, reduce-scatters
    and replicate-axis all-reduces are skipped there, as DTensor skips its own. They ran:
    ``dp=2 x fsdp=1`` reported (and issued) 6 all-gathers of 936,448 B and 3 reduce-scatters
    of 500,992 B on 'fsdp' per step, ``dp=1 x fsdp=2`` 3 all-reduces of 250,496 B on 'dp'.
    The step still equals one device."""
    axes, kwargs = ONE_RANK_AXES[layout]
    base, opt, batch = _tiny(), _opt(), _batch()
    model_bytes = sum(p.numel() * p.element_size() for p in base.params.values())

    def rank() -> tuple[dict, dict, torch.Tensor]:
        mesh = d9d.make_mesh("cpu", **axes)
        model = copy.deepcopy(base)
        step = d9d.shard_params(mesh, **kwargs)(make_train_step(model, opt))
        params, state = step.place(model.params, opt.init(model.params))
        stats = step.comms(params, state, step.shard_batch(batch))
        losses = []
        for _ in range(2):
            params, state, metrics = step(params, state, step.shard_batch(batch))
            losses.append(metrics["loss"])
        return dict(stats.count), dict(stats.bytes), torch.stack(losses)

    one = make_train_step(base, opt)
    params, state, losses = dict(base.params), opt.init(base.params), []
    for _ in range(2):
        params, state, metrics = one(params, state, batch)
        losses.append(metrics["loss"])
    units = 1 + 2  # the params outside blocks, then each block
    data = {"all_reduce": 2, "bytes": 4 + 8}  # the loss and its valid-token count
    expected = {
        "fsdp=1": ({}, {}),
        "dp=2 x fsdp=1": (
            {("all_reduce", "dp"): units + data["all_reduce"]},
            {("all_reduce", "dp"): model_bytes + data["bytes"]},
        ),
        "dp=1 x fsdp=2": (
            {("all_gather", "fsdp"): 2 * units, ("reduce_scatter", "fsdp"): units},
            {("reduce_scatter", "fsdp"): model_bytes},
        ),
        "dp=2 x fsdp=1, ZeRO-2": (
            {("all_reduce", "dp"): units + data["all_reduce"]},
            {("all_reduce", "dp"): model_bytes + data["bytes"]},
        ),
    }[layout]
    ones = {axis for axis, size in axes.items() if size == 1}
    for count, nbytes, got in run_on_ranks(rank, math.prod(axes.values())):
        assert not [key for key in count if key[1] in ones], count
        for key, n in expected[0].items():
            assert count[key] == n, (key, count)
        for key, n in expected[1].items():
            assert nbytes[key] == n, (key, nbytes)
        torch.testing.assert_close(got, torch.stack(losses), rtol=1e-5, atol=0)


def _counted_through_torch_distributed() -> tuple[dict, dict]:
    mesh = d9d.make_mesh("cpu", fsdp=2)
    group = mesh.get_group("fsdp")
    with CollectiveCounter(mesh) as counter:
        dist.all_reduce(torch.ones(3), group=group)
        dist.broadcast_object_list([torch.zeros(5)], src=0, group=group)
    return dict(counter.stats.count), dict(counter.stats.bytes)


def test_collectives_through_torch_distributed_are_counted() -> None:
    """A step's collectives issued through ``torch.distributed`` (a pipeline broadcasts its
    aux outputs with ``broadcast_object_list``) are counted as the functional ones are: an
    all-reduce of its tensor, and the object's two broadcasts (its pickle's length as one
    int64, then the pickle). gloo ranks: the threaded group takes them outside the
    dispatcher."""
    pickled = len(pickle.dumps(torch.zeros(5)))
    for count, nbytes in run_on_ranks(_counted_through_torch_distributed, 2, method="fork"):
        assert count == {("all_reduce", "fsdp"): 1, ("broadcast", "fsdp"): 2}
        assert nbytes == {("all_reduce", "fsdp"): 12, ("broadcast", "fsdp"): 8 + pickled}


@pytest.mark.parametrize("n", [2, 4])
def test_params_and_optimizer_state_per_rank_are_one_nth(n: int) -> None:
    def rank() -> tuple[d9d.transforms.Memory, int, int]:
        mesh = d9d.make_mesh("cpu", fsdp=n)
        model, opt = _tiny(), _opt()
        step = d9d.shard_params(mesh)(make_train_step(model, opt))
        params, state = step.place(model.params, opt.init(model.params))
        return step.memory(params, state), step.plan.bytes_per_rank(), step.plan.padding_bytes()

    total = sum(p.numel() * p.element_size() for p in _tiny().params.values())
    counters = 8 + 8 + 4  # adam's count, the learning-rate count and the learning rate
    for memory, planned, padding in run_on_ranks(rank, n):
        assert padding == 0
        assert memory.params == planned == total // n
        assert memory.grads == total // n
        assert memory.opt_state == 2 * total // n + counters


@pytest.mark.parametrize(
    ("mu_dtype", "nu_dtype", "state_bytes_per_element"),
    [(torch.bfloat16, torch.bfloat16, 2 + 2), (torch.bfloat16, None, 2 + 4)],
)
def test_optimizer_state_bytes_follow_the_moments_dtypes(
    mu_dtype, nu_dtype, state_bytes_per_element
):
    """bfloat16 moments on fsdp=2: 2 bytes per element each, exactly, in ``step.memory`` and
    in the plan's per-dtype state bytes (its table's caption)."""

    def rank() -> tuple[d9d.transforms.Memory, dict[str, int], str]:
        mesh = d9d.make_mesh("cpu", fsdp=2)
        model = _tiny()
        opt = d9d.optim.chain(
            d9d.optim.clip_by_global_norm(1.0),
            d9d.optim.adamw(1e-3, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
        )
        step = d9d.shard_params(mesh)(make_train_step(model, opt))
        params, state = step.place(model.params, opt.init(model.params))
        assert state[1][0].mu["norm.weight"].dtype == mu_dtype
        return step.memory(params, state), step.plan.state_bytes, str(step.plan)

    half = sum(p.numel() for p in _tiny().params.values()) // 2
    counters = 8 + 8 + 4  # adam's count, the learning-rate count and the learning rate
    if nu_dtype is None:
        by_dtype = {"float32": 4 * half + 4, "bfloat16": 2 * half, "int64": 16}
    else:
        by_dtype = {"bfloat16": 4 * half, "int64": 16, "float32": 4}
    for memory, state_bytes, table in run_on_ranks(rank, 2):
        assert memory.params == memory.grads == 4 * half
        assert memory.opt_state == state_bytes_per_element * half + counters
        assert state_bytes == by_dtype
        total = sum(by_dtype.values())
        listed = ", ".join(f"{k} {v:,} B" for k, v in by_dtype.items())
        # The caption wraps at the table's width.
        assert f"optimizer state {total:,} B on this rank: {listed}" in " ".join(table.split())


def test_uneven_dims_are_padded_and_reported() -> None:
    def rank() -> tuple[int, int, tuple]:
        mesh = d9d.make_mesh("cpu", fsdp=4)
        step = d9d.shard_params(mesh)(lambda p, s, b: (p, s, {}))
        params, _ = step.place({"w": torch.ones(7, 3)}, ())
        return (
            step.plan.padding_bytes(),
            step.plan.bytes_per_rank(),
            tuple(params["w"].to_local().shape),
        )

    results = run_on_ranks(rank, 4)
    assert [r[2] for r in results] == [(2, 3), (2, 3), (2, 3), (1, 3)]
    assert results[0][:2] == ((8 - 7) * 3 * 4, 2 * 3 * 4)


def _peak_gathered_bytes(reshard: bool, prefetch: bool = False) -> tuple[int, int, int]:
    """The most bytes of gathered params alive at once during one fsdp=2 step, counting the
    buffers of all-gathers issued ahead (prefetch) from when they are issued."""
    gather, issue = d9d.core._gather.gather_params, d9d.core._gather.issue_gather
    watched: dict[int, tuple[list[tuple[StorageWeakRef, int]], list[int]]] = {}

    def watch(plan: Any, tensors: list[torch.Tensor]) -> None:
        # Autograd keeps saved tensors' storages, not their Python objects: watch storages.
        alive, peak = watched[id(plan)]
        alive.extend((StorageWeakRef(t.untyped_storage()), t.numel() * 4) for t in tensors)
        peak[0] = max(peak[0], sum(size for ref, size in alive if not ref.expired()))

    def tracked(plan: Any, paths: list[str], stored: dict, issued: Any = None) -> dict:
        out = gather(plan, paths, stored, issued)
        watch(plan, list(out.values()))
        return out

    def tracked_issue(plan: Any, paths: list[str], stored: dict) -> Any:
        issued = issue(plan, paths, stored)
        watch(plan, list(issued.buffers.values()))
        return issued

    def rank() -> tuple[int, int, int]:
        mesh = d9d.make_mesh("cpu", fsdp=2)
        model, opt = _tiny(n_layers=4), _opt()
        transform = d9d.shard_params(mesh, reshard_after_forward=reshard, prefetch=prefetch)
        step = transform(make_train_step(model, opt))
        params, state = step.place(model.params, opt.init(model.params))
        peak = [0]
        watched[id(step.plan)] = ([], peak)
        step(params, state, _batch())
        block = sum(v.numel() * 4 for k, v in model.params.items() if k.startswith("layers.0."))
        root = sum(v.numel() * 4 for k, v in model.params.items() if not k.startswith("layers."))
        return peak[0], block, root

    with (
        mock.patch.object(d9d.core._apply, "gather_params", tracked),
        mock.patch.object(shard_runtime, "gather_params", tracked),
        mock.patch.object(shard_regather, "gather_params", tracked),
        mock.patch.object(shard_prefetch, "issue_gather", tracked_issue),
        mock.patch.object(shard_regather, "issue_gather", tracked_issue),
    ):
        return run_on_ranks(rank, 2)[0]


def test_reshard_after_forward_keeps_only_one_block_gathered() -> None:
    peak, block, root = _peak_gathered_bytes(reshard=True)
    assert peak <= root + block
    held, _, _ = _peak_gathered_bytes(reshard=False)
    model_bytes = sum(p.numel() * 4 for p in _tiny(n_layers=4).params.values())
    assert held == model_bytes > root + 3 * block


def test_prefetch_holds_at_most_the_next_block_as_well() -> None:
    peak, block, root = _peak_gathered_bytes(reshard=True, prefetch=True)
    assert root + block < peak <= root + 2 * block


def test_8b_plan_on_64_simulated_ranks_without_allocating() -> None:
    with fake_world(64):
        mesh = d9d.make_mesh("cpu", dp=8, fsdp=8)
        with torch.device("meta"):
            model = d9d.functionalize(Llama(LlamaConfig.preset("8b")))
        opt = d9d.optim.adamw(1e-4)
        step = d9d.shard_params(mesh, "fsdp", replicate_axis="dp")(lambda p, s, b: (p, s, {}))
        params, state = step.place(model.params, opt.init(model.params), axes=model.axes)
        table = step.plan.table(max_rows=10)
        memory = step.memory(params, state)
        explained = step.plan.explain("layers.0.attn.wq.weight")
    assert all(p.device.type == "meta" for p in params.values())
    assert all(leaf.device.type == "meta" for leaf in d9d.tree.leaves(state))
    total = LlamaConfig.preset("8b").num_params * 4
    assert memory.params == step.plan.bytes_per_rank() == total // 8
    assert "layers.31.mlp.w_down.weight" in table and "fsdp:S(0)" in table and "291 params" in table
    assert "logical axes ('heads', 'embed')" in explained and "sharded over 'fsdp'" in explained


def test_make_mesh_errors_state_the_numbers() -> None:
    with pytest.raises(
        MeshError,
        match=r"make_mesh\(fsdp=2\) spans 2 ranks but this process was started alone \(no "
        r"process group, no torchrun\): launch it with `torchrun --nproc-per-node 2 script\.py`",
    ):
        d9d.make_mesh(fsdp=2)
    with fake_world(8):
        with pytest.raises(MeshError, match=r"has 4 ranks but the world has 8"):
            d9d.make_mesh("cpu", fsdp=2, tp=2)
        with pytest.raises(MeshError, match=r"unknown mesh axes \['model'\]"):
            d9d.make_mesh("cpu", model=8)
        with pytest.raises(MeshError, match=r"leave 8 ranks / 3"):
            d9d.make_mesh("cpu", fsdp=-1, tp=3)
        mesh = d9d.make_mesh("cpu", tp=2, fsdp=-1, pp=1)
        assert mesh.mesh_dim_names == ("pp", "fsdp", "tp") and tuple(mesh.shape) == (1, 4, 2)


def test_make_mesh_refuses_a_device_type_that_is_not_here(monkeypatch) -> None:
    """A device type torch does not know, one device, or one this machine lacks is refused by
    make_mesh; it built the mesh and place failed in torch ('Expected one of cpu, cuda, ...
    device type at start of device string: gpu', 'Torch not compiled with CUDA enabled')."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MeshError, match=r"device_type='gpu'\) is not a torch device type"):
        d9d.make_mesh("gpu", fsdp=1)
    with pytest.raises(MeshError, match=r"names one device.*pass the type alone, 'cpu'"):
        d9d.make_mesh("cpu:0", fsdp=1)
    with pytest.raises(MeshError, match=r"this machine has no cuda device .*pass 'cpu'"):
        d9d.make_mesh("cuda", fsdp=1)
    assert not dist.is_initialized()
    with fake_world(2):  # a simulated world serves the device types it fakes (d9d plan)
        assert d9d.make_mesh("cuda", fsdp=2).device_type == "cuda"


def test_transform_errors_name_the_axis_and_fix() -> None:
    with fake_world(4):
        mesh = d9d.make_mesh("cpu", dp=2, fsdp=2)
        with pytest.raises(
            PlanError, match=r"names an axis the mesh does not have: mesh axes are \('dp', 'fsdp'\)"
        ):
            d9d.shard_params(mesh, axis="tp")
        with pytest.raises(PlanError, match=r"mesh axis 'dp' has size 2 but no transform uses it"):
            d9d.shard_params(mesh, "fsdp")(lambda p, s, b: (p, s, {})).place(
                {"w": torch.ones(2)}, ()
            )
        with pytest.raises(PlanError, match=r"mesh axis 'fsdp' is claimed by both"):
            d9d.shard_params(mesh, "fsdp", "dp")(
                d9d.shard_params(mesh, "fsdp")(lambda p, s, b: (p, s, {}))
            )
        step = d9d.shard_params(mesh, "fsdp", "dp")(lambda p, s, b: (p, s, {}))
        with pytest.raises(PlanError, match=r"no plan yet: call step.place"):
            step.plan  # noqa: B018
        with pytest.raises(
            IndivisibleError,
            match=r"batch leaf 'tokens' holds 6 examples, which do not split over 4",
        ):
            step.shard_batch({"tokens": torch.zeros(6, 3)})


TWO_OF_A_KIND = {
    # cut every sequence over cp, then again over ep: losses 12% off one device's, no error
    "context_parallel": lambda mesh: (d9d.context_parallel(mesh), d9d.context_parallel(mesh, "ep")),
    # IndexError in the embedding
    "tensor_parallel": lambda mesh: (d9d.tensor_parallel(mesh), d9d.tensor_parallel(mesh, "ep")),
    # a size mismatch in AdamW's weight decay
    "shard_params": lambda mesh: (
        d9d.shard_params(mesh, "fsdp"),
        d9d.shard_params(mesh, "dp", shard="opt_state"),
    ),
    # the blocks checkpointed twice, under whichever policy the decorator order put inside
    "remat": lambda mesh: (d9d.remat("full", mesh=mesh), d9d.remat("selective", mesh=mesh)),
}


@pytest.mark.parametrize("kind", list(TWO_OF_A_KIND))
def test_two_transforms_of_one_kind_are_refused_by_name(kind: str) -> None:
    """Two transforms of one kind on different mesh axes claim no axis twice, but each
    rewrites the same fields of the plan and hooks the same places of the step: refused
    when the second decorates the step, naming both, whatever their order."""
    with fake_world(32):
        mesh = d9d.make_mesh("cpu", dp=2, fsdp=2, cp=2, tp=2, ep=2)
        first, second = TWO_OF_A_KIND[kind](mesh)
        for outer, inner in ((first, second), (second, first)):
            with pytest.raises(
                PlanError,
                match=rf"the step has two {kind} transforms, .* keep one {kind}\(\.\.\.\)",
            ):
                outer(inner(lambda p, s, b: (p, s, {})))


def test_unplaced_params_are_rejected_before_any_collective() -> None:
    def rank() -> None:
        mesh = d9d.make_mesh("cpu", fsdp=2)
        model, opt = _tiny(), _opt()
        step = d9d.shard_params(mesh)(make_train_step(model, opt))
        placed, state = step.place(model.params, opt.init(model.params))
        with pytest.raises(
            PlanError,
            match=r"param 'embed.weight' is a plain tensor but the plan stores it as \(Shard\(dim=0\),\)",
        ):
            step({**placed, "embed.weight": model.params["embed.weight"]}, state, _batch())
        with pytest.raises(IndivisibleError, match=r"disagree on the batch size"):
            step(
                placed,
                state,
                {
                    "tokens": torch.zeros(2, 4, dtype=torch.long),
                    "labels": torch.zeros(3, 4, dtype=torch.long),
                },
            )

    run_on_ranks(rank, 2)


def test_data_rank_is_the_index_shard_batch_cuts_by() -> None:
    """``data_rank()`` (a loader's ``dp_rank, dp_size``) and ``shard_batch(global_batch)``
    name the same rows; tp ranks share them."""
    with fake_world(8, rank=5):  # dp=1, fsdp=0, tp=1 of (2, 2, 2)
        mesh = d9d.make_mesh("cpu", dp=2, fsdp=2, tp=2)
        shard = d9d.shard_params(mesh, "fsdp", replicate_axis="dp")
        step = d9d.tensor_parallel(mesh)(shard(lambda p, s, b: (p, s, {})))
        assert step.data_rank() == (2, 4) == step.batch_shard()
        batch = {"tokens": torch.arange(16).reshape(8, 2)}
        assert step.shard_batch(batch)["tokens"].tolist() == [[8, 9], [10, 11]]
