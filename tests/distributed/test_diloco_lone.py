"""``d9d.diloco`` in one process, against a stand-in for a torchft Manager of a lone replica
group (its all-reduce over one participant is the identity): rounds come every H steps with
one all-reduce each (of each rank's shard in a group of fsdp=2, which equals one rank, and
the tokens the group trained on in the round, counted over its data ranks, or over its
pipeline stages from the last one), a refused round goes back to the last synced params,
the state's memory is counted, a jitted inner step equals the eager one, and what is not
supported is refused by name. The real lighthouse and replica groups:
tests/distributed/test_diloco.py."""

from __future__ import annotations

import doctest
import importlib

import pytest
import torch
from equivalence import llama, train_step
from lone_manager import LoneManager

import d9d
from d9d.errors import ConfigError, PlanError

F64 = torch.float64


def _build(
    manager, inner_steps=2, outer=None, jit=False, fsdp=1, weighting="tokens", warmup=0, mb=1
):
    torch.manual_seed(0)
    model, opt = llama(F64, n_layers=1)(), d9d.optim.adamw(1e-2)
    mesh = d9d.make_mesh("cpu", fsdp=fsdp)
    inner = d9d.shard_params(mesh, "fsdp", microbatches=mb)(train_step(model, opt))
    if jit:
        inner = d9d.jit(inner, backend="aot_eager")
    step = d9d.diloco(
        manager, inner_steps=inner_steps, outer=outer, weighting=weighting, warmup_steps=warmup
    )(inner)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    return step, params, state


def _batch(i: int) -> dict:
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(i))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def _whole(params: dict) -> dict:
    return {k: v.full_tensor() for k, v in params.items()}


@pytest.mark.parametrize("weighting", ["tokens", "equal"])
def test_a_round_every_h_steps_and_a_refused_one_goes_back_to_the_last_synced_params(
    weighting: str,
) -> None:
    manager = LoneManager(votes=[True, False])
    step, params, state = _build(manager, inner_steps=2, weighting=weighting)
    numel = sum(v.numel() for v in params.values()) + 1  # the group's weight last
    seen = []
    for i in range(4):
        params, state, _ = step(params, state, _batch(i))
        seen.append((list(manager.calls), _whole(params)))
        manager.calls.clear()
    round_calls = ["start_quorum", f"allreduce torch.float64 {numel}", "should_commit"]
    assert [calls for calls, _ in seen] == [[], round_calls, [], round_calls]
    for k, v in seen[3][1].items():  # round 2 refused: the params of round 1, bit for bit
        assert torch.equal(v, seen[1][1][k]), k
    assert not torch.equal(seen[2][1]["head.weight"], seen[1][1]["head.weight"])
    assert int(state.inner_step) == 4


def test_a_warm_up_averages_after_every_step_then_rounds_come_every_h() -> None:
    """warmup_steps=2, H=2: rounds after steps 1, 2 (plain averages: alone, a group keeps its
    params, and the outer Nesterov has not counted a step), then 4 and 6 with the outer step
    (which moves the params past the inner step's)."""
    manager = LoneManager(votes=[True] * 4)
    step, params, state = _build(manager, inner_steps=2, warmup=2)
    torch.manual_seed(0)
    model, opt = llama(F64, n_layers=1)(), d9d.optim.adamw(1e-2)
    alone, alone_state = model.params, opt.init(model.params)
    plain = train_step(model, opt)
    rounds, counts = [], []
    for i in range(4):
        params, state, _ = step(params, state, _batch(i))
        alone, alone_state, _ = plain(alone, alone_state, _batch(i))
        rounds.append(manager.calls.count("start_quorum"))
        manager.calls.clear()
        counts.append(int(state.outer[-1].count))
        if i < 2:  # each warm-up round averaged one group: its own params
            d9d.testing.assert_trees_all_close(_whole(params), alone, rtol=1e-12, atol=1e-14)
    assert rounds == [1, 1, 0, 1]
    assert counts == [0, 0, 0, 1]
    assert not torch.allclose(_whole(params)["head.weight"], alone["head.weight"])
    assert int(state.inner_step) == 4


def _sharded_run() -> tuple[dict, list[str], list[float]]:
    manager = LoneManager(votes=[True, True])
    step, params, state = _build(manager, inner_steps=2, fsdp=2)
    rank = torch.distributed.get_rank()
    for i in range(4):  # this rank's rows of the batch of 4
        params, state, _ = step(params, state, {k: v.chunk(2)[rank] for k, v in _four(i).items()})
    return _whole(params), manager.calls, [float(t[-1]) for t in manager.reduced]


def _four(i: int) -> dict:
    """Rows of two batches; the first row ignores ``i + 3`` labels, so that the ranks of a
    group of two count different tokens."""
    four = {k: torch.cat([_batch(i)[k], _batch(10 + i)[k]]) for k in ("tokens", "labels")}
    four["labels"][0, : i + 3] = -100
    return four


def test_a_group_of_two_fsdp_ranks_reduces_its_shards_and_equals_one_rank() -> None:
    ranks = d9d.testing.run_on_ranks(_sharded_run, 2, method="fork")
    manager = LoneManager(votes=[True, True])
    step, params, state = _build(manager, inner_steps=2)
    for i in range(4):
        params, state, _ = step(params, state, _four(i))
    expected = _whole(params)
    # The tokens of each round's two steps, over the group's two ranks: 64 labels a step.
    tokens = [float(sum(64 - (i + 3) for i in steps)) for steps in ((0, 1), (2, 3))]
    assert [float(t[-1]) for t in manager.reduced] == tokens == [121.0, 117.0]
    for rank, (got, calls, counted) in enumerate(ranks):
        d9d.testing.assert_trees_all_close(got, expected, rtol=1e-10, atol=1e-12)
        # each rank all-reduces its own shard (dim 0 cut as torch.chunk cuts it) and the
        # group's tokens, per round
        shard = sum(
            v[0].numel() * len(torch.arange(v.shape[0]).chunk(2)[rank]) for v in expected.values()
        )
        round_calls = ["start_quorum", f"allreduce torch.float64 {shard + 1}", "should_commit"]
        assert calls == round_calls * 2
        assert counted == tokens


def _pipelined_run() -> list[float]:
    manager = LoneManager(votes=[True])
    torch.manual_seed(0)
    model, opt = llama(F64, n_layers=2)(), d9d.optim.adamw(1e-2)
    mesh = d9d.make_mesh("cpu", pp=2)
    inner = d9d.pipeline(mesh, microbatches=2)(train_step(model, opt))
    step = d9d.diloco(manager, inner_steps=2)(inner)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    for i in range(2):
        params, state, _ = step(params, state, _four(i))
    return [float(t[-1]) for t in manager.reduced]


def test_a_pipelined_group_weighs_its_round_by_the_last_stage_count_on_every_rank() -> None:
    # Only the last stage computes the loss; the first stage's round carries its count too.
    assert d9d.testing.run_on_ranks(_pipelined_run, 2, method="fork") == [[121.0]] * 2


def test_memory_counts_the_anchor_and_the_outer_momentum() -> None:
    step, params, state = _build(LoneManager())
    param_bytes = sum(v.numel() for v in params.values()) * 8  # float64
    inner = step.step.memory(params, state.inner)
    got = step.memory(params, state)
    # the anchor and Nesterov's buffer (a copy of the params each), scale_by_learning_rate's
    # int64 count and float32 learning rate, the inner step and token counters
    assert got.opt_state - inner.opt_state == 2 * param_bytes + 8 + 4 + 8 + 8
    assert (got.params, got.grads) == (inner.params, inner.grads)


def test_memory_keeps_the_grads_the_inner_step_accumulates() -> None:
    """Under microbatches the inner step holds its whole grads until it reduces them once;
    diloco's memory kept only params, grads and state, and lost them (0)."""
    step, params, state = _build(LoneManager(), mb=2)
    inner = step.step.memory(params, state.inner)
    got = step.memory(params, state)
    param_bytes = sum(v.numel() for v in params.values()) * 8  # float64, one rank
    assert got.accumulated_grads == inner.accumulated_grads == param_bytes
    assert got.at_reduction - inner.at_reduction == got.opt_state - inner.opt_state > 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"inner_steps": 0}, r"diloco\(inner_steps=0\) must be an int >= 1"),
        ({"inner_steps": True}, r"diloco\(inner_steps=True\) must be an int >= 1"),
        ({"inner_steps": 8, "outer": 0.7}, r"diloco\(outer=0.7\) must be a d9d.optim Gradient"),
        (
            {"inner_steps": 4, "warmup_steps": 6},
            r"diloco\(warmup_steps=6\) must be an int >= 0 and a multiple of inner_steps=4",
        ),
        (
            {"inner_steps": 4, "warmup_steps": -4},
            r"diloco\(warmup_steps=-4\) must be an int >= 0",
        ),
        (
            {"inner_steps": 8, "weighting": "mean"},
            r"diloco\(weighting='mean'\) must be one of \('tokens', 'equal'\)",
        ),
    ],
)
def test_bad_options_are_refused_by_name(options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        d9d.diloco(LoneManager(), **options)


def test_a_manager_without_its_methods_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"diloco needs a torchft.Manager, got object without"):
        d9d.diloco(object(), inner_steps=8)


def test_what_diloco_cannot_wrap_is_refused_by_name() -> None:
    wrap = d9d.diloco(LoneManager(), inner_steps=2)
    step, _, _ = _build(LoneManager())
    with pytest.raises(PlanError, match="diloco was applied twice to one step"):
        wrap(step)
    mesh = d9d.make_mesh("cpu", fsdp=1)
    with pytest.raises(PlanError, match=r"shard_params was applied to a step already under d9d"):
        d9d.shard_params(mesh, "fsdp")(step)
    with pytest.raises(PlanError, match=r"jit was applied to a step under d9d.diloco.*d9d.jit\("):
        d9d.jit(step)
    with pytest.raises(PlanError, match=r"diloco wraps d9d.jit of a plain function"):
        wrap(d9d.jit(lambda params, opt_state, batch: (params, opt_state, {})))


def test_fault_tolerant_inside_is_refused_when_placed() -> None:
    torch.manual_seed(0)
    model, opt = llama(F64, n_layers=1)(), d9d.optim.adamw(1e-2)
    mesh = d9d.make_mesh("cpu", fsdp=1)
    inner = d9d.fault_tolerant(LoneManager())(
        d9d.shard_params(mesh, "fsdp")(train_step(model, opt))
    )
    step = d9d.diloco(LoneManager(), inner_steps=2)(inner)
    with pytest.raises(PlanError, match=r"vote on every step's commit \(d9d.fault_tolerant\)"):
        step.place(model.params, opt.init(model.params), model=model)


def test_a_lone_bfloat16_group_keeps_its_params_through_plain_average_rounds() -> None:
    """Alone, a round of outer sgd(1.0) lands the anchor on the group's params: bitwise the
    plain inner steps', with bfloat16 params too. The pseudo-gradients once travelled in
    bfloat16, their token-weighted sum and its division each rounding: the first round moved
    10004 of the 79040 params, by up to 1.2e-4, and the runs drifted apart from there."""
    torch.manual_seed(0)
    model, opt = llama(torch.bfloat16, n_layers=1)(), d9d.optim.adamw(1e-2)
    manager = LoneManager(votes=[True, True])
    step = d9d.diloco(manager, inner_steps=2, outer=d9d.optim.sgd(1.0))(train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    alone, alone_state = params, state.inner
    for i in range(4):
        params, state, _ = step(params, state, _batch(i))
        alone, alone_state, _ = step.step(alone, alone_state, _batch(i))
        for k, v in _whole(params).items():
            assert v.dtype == torch.bfloat16 and torch.equal(v, alone[k].full_tensor()), (i, k)
    numel = sum(v.numel() for v in params.values()) + 1  # the count in the same collective
    round_calls = ["start_quorum", f"allreduce torch.float32 {numel}", "should_commit"]
    assert manager.calls == round_calls * 2


def test_master_weights_inside_is_refused_when_placed() -> None:
    """Its float32 masters would carry the group's params from before a round into the next
    inner step, undoing the round (an outer sgd(3.0) round then put the tiny bfloat16 Llama's
    params 0.0298 away from a step from the round's params)."""
    torch.manual_seed(0)
    model = llama(torch.bfloat16, n_layers=1)()
    opt = d9d.optim.chain(
        d9d.optim.clip_by_global_norm(1.0), d9d.optim.master_weights(d9d.optim.adamw(1e-2))
    )
    step = d9d.diloco(LoneManager(), inner_steps=2)(train_step(model, opt))
    with pytest.raises(
        PlanError,
        match=r"diloco does not run with an inner optimizer that keeps"
        r" master copies of the params \(d9d.optim.master_weights\) yet",
    ):
        step.place(model.params, opt.init(model.params), model=model)


def test_the_step_takes_its_diloco_state() -> None:
    step, params, state = _build(LoneManager())
    with pytest.raises(TypeError, match="a diloco step takes a DiLoCoState"):
        step(params, state.inner, _batch(0))


def test_a_loss_that_counts_no_tokens_is_refused_under_token_weighting() -> None:
    torch.manual_seed(0)
    model, opt = llama(F64, n_layers=1)(), d9d.optim.sgd(0.1)

    def inner(params, opt_state, batch):  # a loss without d9d.losses.token_mean
        loss_fn = lambda p: model.apply(p, batch["tokens"]).square().mean()  # noqa: E731
        loss, grads = d9d.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return d9d.optim.apply_updates(params, updates), opt_state, {"loss": loss}

    def build(weighting: str) -> tuple:
        manager = LoneManager(votes=[True])
        step = d9d.diloco(manager, inner_steps=1, weighting=weighting)(inner)
        return manager, step, *step.place(model.params, opt.init(model.params), model=model)

    manager, step, params, state = build("equal")
    step(params, state, _batch(0))  # the groups weigh alike: the pseudo-gradients and a 1
    numel = sum(v.numel() for v in params.values()) + 1
    assert manager.calls == ["start_quorum", f"allreduce torch.float64 {numel}", "should_commit"]
    _, step, params, state = build("tokens")
    with pytest.raises(PlanError, match=r"this inner step's loss counted none .*'equal'\)"):
        step(params, state, _batch(0))


@pytest.mark.compile
def test_a_jitted_inner_step_equals_the_eager_one() -> None:
    results = []
    for jit in (False, True):
        step, params, state = _build(LoneManager(votes=[True, True]), jit=jit)
        for i in range(4):
            params, state, _ = step(params, state, _batch(i))
        results.append(_whole(params))
    d9d.testing.assert_trees_all_close(results[1], results[0], rtol=1e-10, atol=1e-12)


def test_docstring_example_runs() -> None:
    module = importlib.import_module("d9d.transforms.diloco._transform")
    assert doctest.testmod(module, raise_on_error=True).attempted > 0


class _Serving(LoneManager):
    """Asks this group's state at each quorum, as torchft does when a peer heals from it."""

    served = None

    def start_quorum(self) -> None:
        super().start_quorum()
        self.served = self.state_fns["d9d.diloco"][1]()


class _Meeting(LoneManager):
    """Adds ``others`` (what the other groups all-reduce, call by call) to this group's first
    all-reduces, as its round's all-reduce with them does; alone after those."""

    def __init__(self, votes: list[bool], others: list[torch.Tensor]) -> None:
        super().__init__(votes)
        self.others = list(others)

    def allreduce(self, tensor: torch.Tensor, reduce_op: object = None) -> LoneManager:
        super().allreduce(tensor, reduce_op)
        if self.others:
            tensor.add_(self.others.pop(0))
        return self


def test_a_group_that_heals_inside_a_round_finishes_it_and_goes_on_bitwise() -> None:
    peer = _Serving(votes=[True, True])
    step, params, state = _build(peer, inner_steps=2)
    for i in range(2):
        params, state, _ = step(params, state, _batch(i))
    assert peer.served["in_round"] is True
    # The late group's round meets the peer's all-reduce; it adds nothing of its own (its
    # pseudo-gradient is a copy of the peer's, weighing 0), so the round is the peer's.
    late = _Meeting(votes=[True, True], others=peer.reduced)
    late_step, late_params, late_state = _build(late, inner_steps=2)
    late_params = {k: v + 1 for k, v in late_params.items()}  # not what the peer holds
    late.state_fns["d9d.diloco"][0](peer.served)  # torchft hands it over at the quorum
    late_params, late_state = late_step.join(late_params, late_state)
    assert not late.reduced[0].any()  # zeros: the pseudo-gradient and the count weigh 0
    numel = sum(v.numel() for v in params.values()) + 1  # and the group's weight
    # The peer's round run to its end, in the quorum the caller started: no quorum of its own.
    assert late.calls == [f"allreduce torch.float64 {numel}", "should_commit"]
    assert int(late_state.inner_step) == 2
    for i in (2, 3):
        params, state, _ = step(params, state, _batch(i))
        late_params, late_state, _ = late_step(late_params, late_state, _batch(i))
    got, want = d9d.tree.leaves((late_params, late_state)), d9d.tree.leaves((params, state))
    assert len(got) == len(want) > 2 * len(params)  # the inner, anchor and outer states came
    for a, b in zip(got, want, strict=True):
        a, b = (x.to_local() if hasattr(x, "to_local") else x for x in (a, b))
        assert torch.equal(a, b)


def test_a_group_resumed_behind_heals_from_a_restored_peer_without_a_round() -> None:
    # Groups resumed from checkpoints of different steps meet at a quorum before their first
    # step: the one behind takes what the one ahead restored (served by step.serve), and no
    # round follows.
    peer = LoneManager()
    step, params, state = _build(peer)
    restored = {k: v + 1 for k, v in params.items()}
    restored_state = state._replace(inner_step=torch.tensor(4), anchor=restored)
    step.serve(restored, restored_state)
    served = peer.state_fns["d9d.diloco"][1]()
    assert served["in_round"] is False
    late = LoneManager()
    late_step, late_params, late_state = _build(late)
    late.state_fns["d9d.diloco"][0](served)
    late_params, late_state = late_step.join(late_params, late_state)
    assert late.calls == [] and int(late_state.inner_step) == 4
    for k, v in late_params.items():
        assert torch.equal(v.to_local(), restored[k].to_local()), k
        assert torch.equal(late_state.anchor[k].to_local(), restored[k].to_local()), k


def test_an_unplaced_step_serves_nothing_and_says_so() -> None:
    step, params, state = _build(LoneManager())
    unplaced = d9d.diloco(LoneManager(), inner_steps=2)(step.step)
    with pytest.raises(PlanError, match=r"a diloco step runs after step\.place\(params, opt_st"):
        unplaced.serve(params, state)


def test_a_group_that_did_not_heal_joins_with_its_own_state() -> None:
    manager = LoneManager()
    step, params, state = _build(manager)
    joined, joined_state = step.join(params, state)
    assert joined is params and joined_state is state and manager.calls == []


def test_a_placed_group_counts_minus_one_round_until_its_first_inner_step() -> None:
    # Behind groups that train, even before their first committed round: torchft heals a
    # group restarted then (its count behind the quorum's) at their next quorum.
    manager = LoneManager(votes=[True])
    step, params, state = _build(manager, inner_steps=2)
    assert manager.current_step() == -1
    params, state, _ = step(params, state, _batch(0))
    assert manager.current_step() == 0
    params, state, _ = step(params, state, _batch(1))
    assert manager.current_step() == 1  # the round committed
