"""``d9d.fault_tolerant`` in one process, against a stand-in for a torchft Manager of a lone
replica group (its all-reduce over one participant is the identity): the step equals the
plain step, a refused commit returns the step's inputs, and what is not supported is refused
by name. The real lighthouse and replica groups: tests/distributed/test_fault_tolerant.py."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import subprocess
import sys

import pytest
import torch
from equivalence import batches, llama, optimizer, train_step
from lone_manager import LoneManager

import d9d
from d9d.errors import ConfigError, PlanError
from d9d.models.moe import make_train_step as make_moe_train_step
from d9d.testing import run_on_ranks
from d9d.transforms.fault_tolerant import FaultTolerantRuntime

F64 = torch.float64


def _run(model, opt, step, data):
    params, state = step.place(model.params, opt.init(model.params), model=model)
    out = []
    for batch in data:
        new_params, new_state, metrics = step(params, state, batch)
        out.append((params, state, new_params, new_state, metrics["loss"]))
        params, state = new_params, new_state
    return out


def _build(manager=None, axis="fsdp", **shard):
    torch.manual_seed(0)
    model, opt = llama(F64, n_layers=1)(), optimizer("adamw")
    mesh = d9d.make_mesh("cpu", **{axis: 1})
    step = d9d.shard_params(mesh, axis, **shard)(train_step(model, opt))
    return model, opt, step if manager is None else d9d.fault_tolerant(manager)(step)


def _assert_runs_equal(got: list, want: list) -> None:
    """Each step's loss (rel 1e-12) and whole params (rel 1e-10) of ``_run``'s two runs."""
    for (_, _, got_params, _, got_loss), (_, _, want_params, _, want_loss) in zip(
        got, want, strict=True
    ):
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=0)
        d9d.testing.assert_trees_all_close(
            {k: v.full_tensor() for k, v in got_params.items()},
            {k: v.full_tensor() for k, v in want_params.items()},
            rtol=1e-10,
            atol=1e-12,
        )


def test_a_lone_replica_group_equals_the_plain_step_and_a_refused_commit_keeps_the_inputs():
    data = batches(128, global_batch=2, steps=3)
    manager = LoneManager([True, False, True])
    model, opt, step = _build(manager)
    runs = _run(model, opt, step, data)
    # The refused step (the second) returns exactly what it was given...
    given_params, given_state, params, state, _ = runs[1]
    assert params is given_params and state is given_state
    # ...and the steps around it equal the plain step on the batches that were committed.
    plain = _run(*_build(), [data[0], data[2]])
    _assert_runs_equal([runs[0], runs[2]], plain)
    # One quorum, one all-reduce (one dtype: grads, weighted loss and token count), one vote.
    params_numel = sum(p.numel() for p in model.params.values())
    assert manager.calls[:3] == [
        "start_quorum",
        f"allreduce torch.float64 {params_numel + 2}",
        "should_commit",
    ]
    assert len(manager.calls) == 9


def _flat(tree: object) -> list[torch.Tensor]:
    leaves = d9d.tree.leaves(tree)
    return [x.to_local() if hasattr(x, "to_local") else x for x in leaves if torch.is_tensor(x)]


def test_a_rejoining_group_steps_on_from_the_peers_state_bitwise():
    # A peer runs 2 steps and serves what its third step will be called with; a fresh group
    # (initial params of another seed) takes it at its first step: both third steps give
    # bitwise equal params and optimizer state.
    data = batches(128, global_batch=2, steps=3)
    peer = LoneManager([True] * 3)
    model, opt, step = _build(peer)
    runs = _run(model, opt, step, data[:2])
    served = peer.state_fns["d9d.fault_tolerant"][1]()  # as torchft asks, at a quorum
    want_params, want_state, want_metrics = step(runs[-1][2], runs[-1][3], data[2])
    late = LoneManager([True])
    torch.manual_seed(1)
    model2, opt2, step2 = _build(late)
    params, state = step2.place(model2.params, opt2.init(model2.params), model=model2)
    late.state_fns["d9d.fault_tolerant"][0](served)  # torchft hands it over at the quorum
    new_params, new_state, metrics = step2(params, state, data[2])
    assert metrics["loss"].item() == want_metrics["loss"].item()
    got, want = _flat((new_params, new_state)), _flat((want_params, want_state))
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert len(_flat(new_state)) > len(new_params)  # the moments and count came along


def test_microbatches_equal_the_whole_batch_with_one_all_reduce_per_step():
    # Uneven ignored labels: the first microbatch (row 0) counts 4 of its 16 tokens.
    data = batches(128, global_batch=2, steps=2)
    for batch in data:
        batch["labels"] = batch["labels"].clone()
        batch["labels"][0, 4:] = -100
    manager = LoneManager([True, True])
    torch.manual_seed(0)
    model, opt = llama(F64, n_layers=1)(), optimizer("adamw")
    mesh = d9d.make_mesh("cpu", fsdp=1)
    rows = []  # the rows of each forward: proof that the batch was split

    def counting_step(params, opt_state, batch):
        def loss_fn(params, batch):
            rows.append(batch["tokens"].shape[0])
            logits = model.apply(params, batch["tokens"])
            return d9d.losses.cross_entropy(logits, batch["labels"])

        loss, grads = d9d.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return d9d.optim.apply_updates(params, updates), opt_state, {"loss": loss}

    accumulating = d9d.fault_tolerant(manager, microbatches=2)(
        d9d.shard_params(mesh, "fsdp")(counting_step)
    )
    got = _run(model, opt, accumulating, data)
    assert rows == [1, 1, 1, 1]
    want = _run(*_build(), data)  # one device fed the whole batch
    _assert_runs_equal(got, want)
    numel = sum(v.numel() for v in model.params.values())
    # Once per step, after the last microbatch: the grads and (loss x count, count).
    per_step = ["start_quorum", f"allreduce torch.float64 {numel + 2}", "should_commit"]
    assert manager.calls == per_step * 2


def test_microbatches_must_be_a_positive_int():
    with pytest.raises(PlanError, match=r"fault_tolerant needs microbatches >= 1, got microbat"):
        d9d.fault_tolerant(LoneManager([]), microbatches=0)


def test_a_peer_of_another_layout_is_refused_by_name():
    peer = LoneManager([True])
    model, opt, step = _build(peer)  # mesh (fsdp=1)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    step(params, state, batches(128, global_batch=2, steps=1)[0])
    late = LoneManager([True])
    model2, opt2, step2 = _build(late, axis="dp")  # mesh (dp=1)
    params2, state2 = step2.place(model2.params, opt2.init(model2.params), model=model2)
    late.state_fns["d9d.fault_tolerant"][0](peer.state_fns["d9d.fault_tolerant"][1]())
    with pytest.raises(
        PlanError,
        match=r"cannot rejoin: .*laid out otherwise \(the peer holds 'params\.\S+: torch\.float64 "
        r".*on mesh \(fsdp=1\).*this rank '.*on mesh \(dp=1\).*restart it with the mesh",
    ):
        step2(params2, state2, batches(128, global_batch=2, steps=1)[0])


def test_nothing_is_served_before_a_step_ran():
    manager = LoneManager([])
    model, opt, step = _build(manager)
    step.place(model.params, opt.init(model.params), model=model)
    with pytest.raises(PlanError, match=r"a peer asked for live state before any step ran"):
        manager.state_fns["d9d.fault_tolerant"][1]()


def test_a_restored_state_is_served_before_any_step_ran():
    # A group resumed from its checkpoint serves what it restored to a group behind it.
    manager = LoneManager([])
    model, opt, step = _build(manager)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    (runtime,) = [r for r in step.runtimes if isinstance(r, FaultTolerantRuntime)]
    restored = {k: v + 1 for k, v in params.items()}  # not what place returned
    runtime.serve(restored, state)
    served = manager.state_fns["d9d.fault_tolerant"][1]()
    for piece, leaf in zip(served["pieces"], d9d.tree.leaves(restored), strict=False):
        assert torch.equal(piece, leaf.to_local())
    # Healed from a peer before any step ran: a third group healing from this one gets the
    # peer's state, not the older restored one.
    load, serve = manager.state_fns["d9d.fault_tolerant"]
    peers = {"layout": served["layout"], "pieces": [p * 2 for p in served["pieces"]]}
    load(peers)
    assert serve() is peers


def test_an_eval_step_sharing_the_plan_neither_meets_the_groups_nor_votes():
    data = batches(128, global_batch=2, steps=1)
    manager = LoneManager([True])
    model, opt, step = _build(manager)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    params, state, _ = step(params, state, data[0])
    calls = list(manager.calls)

    def evaluate(params, opt_state, batch):
        with torch.no_grad():
            logits = model.apply(params, batch["tokens"])
        return params, opt_state, {"loss": d9d.losses.cross_entropy(logits, batch["labels"])}

    _, _, metrics = step.sharing_plan(evaluate)(params, None, data[0])
    assert manager.calls == calls  # no quorum, no all-reduce, no vote
    assert torch.isfinite(metrics["loss"])
    served = manager.state_fns["d9d.fault_tolerant"][1]()  # still the training step's state
    assert len(served["pieces"]) == len(params) + len(d9d.tree.leaves(state))


def test_fault_tolerant_refuses_what_is_not_a_manager():
    with pytest.raises(PlanError, match=r"needs a torchft\.Manager, got object without"):
        d9d.fault_tolerant(object())


@pytest.mark.parametrize(
    ("wrap", "error"),
    [
        (d9d.fault_tolerant, PlanError),
        (lambda manager: d9d.diloco(manager, inner_steps=4), ConfigError),
    ],
    ids=["fault_tolerant", "diloco"],
)
def test_a_manager_with_an_async_quorum_is_refused(wrap, error):
    # torchft's default: a rejoining group would load its peer's state only at the commit
    # vote, after it computed on its own params (two fault_tolerant groups on a real
    # lighthouse ended 0.0198 apart in their params, their AdamW counts 3 and 4; a diloco
    # group would put its stale pseudo-gradient into the round's average).
    torchft = pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=lighthouse.address(),
        replica_id="group0",
        init_sync=False,
    )  # use_async_quorum left at its default, True
    try:
        with pytest.raises(
            error,
            match=r"needs a torchft\.Manager built with use_async_quorum=False, got one with "
            r"use_async_quorum=True .*one step behind.*pass use_async_quorum=False to Manager",
        ):
            wrap(manager)
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()


def test_a_moe_model_is_refused_by_name():
    # Its expert loads would be summed over the group's ranks only: two d9d train groups of
    # --model moe logged eval losses 5.439270 and 5.439284 after step 2 (their router
    # biases nudged by their own loads), where every group should hold the same params.
    from d9d.models import MoE, MoEConfig

    torch.manual_seed(0)
    model = d9d.functionalize(MoE(MoEConfig.tiny()))
    opt = d9d.optim.adamw(1e-3)
    step = d9d.fault_tolerant(manager := LoneManager([True]))(
        d9d.shard_params(d9d.make_mesh("cpu", fsdp=1), "fsdp")(make_moe_train_step(model, opt))
    )
    params, state = step.place(model.params, opt.init(model.params), model=model)
    tokens = torch.randint(0, 256, (2, 9))
    with pytest.raises(
        PlanError,
        match=r"d9d\.moe sums its expert loads over the step's mesh only, and under "
        r"fault_tolerant, whose other replica groups hold tokens of the step: .*drift apart",
    ):
        step(params, state, {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    assert "should_commit" not in manager.calls
    # Without balancing its loads are a metric only, and nothing can drift: it runs.
    config = MoEConfig.tiny()
    quiet = dataclasses.replace(
        config.moe, aux_loss_coef=0.0, z_loss_coef=0.0, bias_update_rate=0.0
    )
    model = d9d.functionalize(MoE(dataclasses.replace(config, moe=quiet)))
    step = d9d.fault_tolerant(LoneManager([True]))(
        d9d.shard_params(d9d.make_mesh("cpu", fsdp=1), "fsdp")(make_moe_train_step(model, opt))
    )
    params, state = step.place(model.params, opt.init(model.params), model=model)
    step(params, state, {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})


def test_fault_tolerant_refuses_microbatches_of_another_transform():
    model, opt, step = _build(LoneManager([]), microbatches=2)
    with pytest.raises(PlanError, match=r"both run d9d\.value_and_grad"):
        step.place(model.params, opt.init(model.params), model=model)


def _pipelined_rank() -> None:
    """A lone group of pp=2 x fsdp=2 (this rank's stage, its fsdp shard) against the same
    pipelined step without fault_tolerant: asserts, raising on failure."""
    mesh = d9d.make_mesh("cpu", pp=2, fsdp=2)

    def build(manager=None, **ft):
        torch.manual_seed(0)
        model, opt = llama(F64, n_layers=2)(), optimizer("adamw")
        step = d9d.pipeline(mesh, microbatches=2)(train_step(model, opt))
        step = d9d.shard_params(mesh, "fsdp")(step)
        return model, opt, step if manager is None else d9d.fault_tolerant(manager, **ft)(step)

    model, opt, step = build(LoneManager([]), microbatches=2)
    with pytest.raises(
        PlanError, match=r"fault_tolerant\(microbatches=2\) does not run under a pi"
    ):
        step.place(model.params, opt.init(model.params), model=model)
    data = batches(128, global_batch=4, steps=3)
    for batch in data:  # uneven valid tokens over the microbatches and fsdp ranks
        batch["labels"] = batch["labels"].clone()
        batch["labels"][0, 5:] = -100
    manager = LoneManager([True, False, True])
    got = _run_sharded(*build(manager), data)
    given_params, given_state, params, state, _ = got[1]  # refused: the step's inputs back
    assert params is given_params and state is given_state
    _assert_runs_equal([got[0], got[2]], _run_sharded(*build(), [data[0], data[2]]))
    # This rank's stage, its fsdp shard: the all-reduce carries its local pieces only.
    numel = sum(v.to_local().numel() for v in params.values())
    assert numel < sum(v.numel() for v in model.params.values()) // 2
    assert manager.calls[:3] == [
        "start_quorum",
        f"allreduce torch.float64 {numel + 2}",
        "should_commit",
    ]


def _run_sharded(model, opt, step, data):
    params, state = step.place(model.params, opt.init(model.params), model=model)
    out = []
    for batch in data:
        new_params, new_state, metrics = step(params, state, step.shard_batch(batch))
        out.append((params, state, new_params, new_state, metrics["loss"]))
        params, state = new_params, new_state
    return out


def test_a_lone_pipelined_group_equals_the_plain_pipeline_and_a_refused_commit_keeps_the_inputs():
    run_on_ranks(_pipelined_rank, 4, method="fork")


def test_fault_tolerant_refuses_jit():
    model, opt, step = _build(LoneManager([]))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    with pytest.raises(PlanError, match=r"fault_tolerant runs eagerly.*drop d9d\.jit"):
        d9d.jit(step)(params, state, batches(128, global_batch=2, steps=1)[0])


def test_fault_tolerant_refuses_step_comms():
    model, opt, step = _build(manager := LoneManager([]))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    with pytest.raises(PlanError, match=r"step\.comms runs a step, and under fault_tolerant"):
        step.comms(params, state, batches(128, global_batch=2, steps=1)[0])
    assert manager.calls == []  # refused before any quorum


def test_d9d_imports_without_torchft():
    code = (
        "import sys; sys.modules['torchft'] = None; import d9d, d9d.transforms, "
        "d9d.cli.train._run; print(d9d.fault_tolerant.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "fault_tolerant", done.stderr[-2000:]


def test_docstring_example_runs():
    module = importlib.import_module("d9d.transforms.fault_tolerant._transform")
    assert doctest.testmod(module, raise_on_error=True).attempted > 0
