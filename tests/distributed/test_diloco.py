"""``d9d.diloco`` on a real torchft lighthouse: replica groups as processes of their own.

(a) H=1 with a plain outer SGD of lr 1 equals synchronous data parallelism: one device fed
both groups' batches (float64, inner SGD with momentum and weight decay, linear in the grads),
with labels ignored unevenly between the groups: each group's pseudo-gradient weighs by its
share of the tokens.
(b) H=3 with the default outer Nesterov equals DiLoCo simulated in one process with
``torch.optim.SGD(nesterov=True)`` as the outer optimizer; both groups end bitwise equal, and
the manager saw one all-reduce of every param element per round (counted outside d9d).
(c) A group SIGKILLed inside an outer round: the survivor's round is not committed, it goes
on from the last synced params, and its next round runs alone; it logs one line for each.
(d) That group restarted rejoins at the survivor's next round with its state (params, inner
state, anchor, outer state, inner step): the survivor never repeats a step, and both groups
end bitwise equal, equal to the rounds simulated in one process. (e) So does a group killed
before the first round committed, at the survivor's first round. (f) Among three groups, the
restarted group weighs nothing in the round it rejoins at (its pseudo-gradient is a copy).

Every ordering is an event (a line on a pipe, a process's exit), none a sleep.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from equivalence import llama, train_step

from d9d import tree
from d9d.testing import assert_trees_all_close

torchft = pytest.importorskip("torchft")
from diloco_replica import batch_of, inner_optimizer  # noqa: E402
from torchft.coordination import LighthouseServer  # noqa: E402

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent


def _lighthouse(min_replicas: int = 1) -> LighthouseServer:
    # As test_fault_tolerant.py: a quorum waits for every heartbeating group to ask; a dead
    # group stops counting 2 s after its last heartbeat.
    return LighthouseServer(
        bind="[::]:0",
        min_replicas=min_replicas,
        join_timeout_ms=60_000,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=2_000,
    )


def _start(lighthouse: LighthouseServer, tmp_path: Path, name: str, *args: str) -> subprocess.Popen:
    """A replica group's process (``diloco_replica.py *args``), once it said ``ready``."""
    command = [
        *(sys.executable, str(HERE / "diloco_replica.py"), f"--lighthouse={lighthouse.address()}"),
        *(*args, f"--out={tmp_path / f'{name}.jsonl'}"),
    ]
    # stderr into a file: a pipe nobody reads would fill with torchft's log lines.
    with (tmp_path / f"{name}.err").open("w") as err:
        proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, cwd=HERE
        )
    line = proc.stdout.readline().strip()
    assert line == "ready", f"replica group said {line!r} (rc={proc.poll()})"
    return proc


def _go(proc: subprocess.Popen) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    proc.stdin.close()


def _run_groups(
    tmp_path: Path,
    steps: int,
    inner_steps: int,
    outer: str,
    die: int = -1,
    ignored: int = 0,
    warmup: int = 0,
) -> list:
    """Both groups' runs, group 1 dying inside round ``die`` (>= 0) and ignoring the first
    ``ignored`` labels of its rows, after ``warmup`` steps each followed by an averaging
    round; their return codes."""
    lighthouse = _lighthouse()
    try:
        procs = [
            _start(
                lighthouse,
                tmp_path,
                f"group{group}",
                *(f"--group={group}", f"--steps={steps}", f"--inner-steps={inner_steps}"),
                *(f"--outer={outer}", f"--ignored={ignored}", f"--warmup-steps={warmup}"),
                *([f"--die-in-round={die}"] if group == 1 else []),
            )
            for group in (0, 1)
        ]
        for proc in procs:
            _go(proc)
        return [proc.wait(timeout=240) for proc in procs]
    finally:
        lighthouse.shutdown()


def _result(tmp_path: Path, group: int | str) -> tuple[list[dict], dict, dict]:
    out = tmp_path / f"group{group}.jsonl"
    log = [json.loads(line) for line in out.read_text().splitlines()]
    counts = json.loads(Path(f"{out}.counts.json").read_text())
    return log, counts, torch.load(f"{out}.params.pt")


def _fresh() -> tuple:
    torch.manual_seed(0)
    model = llama(torch.float64, n_layers=1)()
    return model, tree.map(torch.clone, model.params)


def _simulate(
    steps: int,
    inner_steps: int,
    outer_lr: float,
    momentum: float,
    rounds: list,
    rejoins: dict[int, tuple[int, int]] | None = None,
    groups: int = 2,
    warmup: int = 0,
):
    """DiLoCo in one process: each of ``groups`` groups' inner steps with d9d's step, the
    outer step with ``torch.optim.SGD`` on the anchor (after each of the first ``warmup``
    steps, the anchor the groups' mean instead); ``rounds[i]`` the groups averaged in
    round ``i``, or None for a round that does not commit; ``rejoins[i] = (dst, src)``: group
    ``dst`` takes group ``src``'s params and inner state before round ``i``. Group 0's final
    params."""
    model, params = _fresh()
    opt = inner_optimizer()
    step = train_step(model, opt)
    anchor = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    # d9d's schedules give the learning rate as a float32 tensor (0.7 is 0.699999988).
    lr = torch.tensor(outer_lr, dtype=torch.float32).item()
    outer = torch.optim.SGD(anchor.values(), lr=lr, momentum=momentum, nesterov=momentum > 0)
    states = [[tree.map(torch.clone, params), opt.init(params)] for _ in range(groups)]
    for at in range(steps):
        for g, (p, s) in enumerate(states):
            states[g][0], states[g][1], _ = step(p, s, batch_of(g, at))
        if at < warmup:
            mean = {k: torch.stack([s[0][k] for s in states]).mean(0) for k in anchor}
            for k, a in anchor.items():
                a.data.copy_(mean[k])
            for state in states:
                state[0] = {k: a.detach().clone() for k, a in anchor.items()}
            continue
        if (at + 1) % inner_steps:
            continue
        at_round = (at + 1 - warmup) // inner_steps - 1
        if at_round in (rejoins or {}):
            dst, src = rejoins[at_round]
            states[dst] = [
                tree.map(torch.clone, states[src][0]),
                tree.map(torch.clone, states[src][1]),
            ]
        averaged = rounds[at_round]
        if averaged is not None:
            for k, a in anchor.items():
                a.grad = torch.stack([a.detach() - states[g][0][k] for g in averaged]).mean(0)
            outer.step()
        for state in states:
            state[0] = {k: a.detach().clone() for k, a in anchor.items()}
    return states[0][0]


def _numel() -> int:
    return sum(v.numel() for v in _fresh()[1].values())


@pytest.mark.timeout(300)
def test_one_inner_step_and_outer_sgd_of_lr_1_is_data_parallelism(tmp_path: Path) -> None:
    # Group 1 ignores 5 of each row's 16 labels: 32 tokens a step against group 0's 22.
    steps, ignored = 4, 5
    assert _run_groups(tmp_path, steps, inner_steps=1, outer="sgd1", ignored=ignored) == [0, 0]
    model, params = _fresh()
    opt = inner_optimizer()
    step, state, losses = train_step(model, opt), opt.init(params), []
    for at in range(steps):
        a, b = batch_of(0, at, ignored), batch_of(1, at, ignored)
        params, state, metrics = step(params, state, {k: torch.cat([a[k], b[k]]) for k in a})
        losses.append(metrics["loss"])
    logs = [_result(tmp_path, g) for g in (0, 1)]
    # Each group logs its own loss, the mean over its tokens: weighed by their counts, the
    # global one.
    mean = [
        (32 * x["loss"] + 22 * y["loss"]) / 54 for x, y in zip(logs[0][0], logs[1][0], strict=True)
    ]
    torch.testing.assert_close(
        torch.tensor(mean, dtype=torch.float64), torch.stack(losses), rtol=1e-12, atol=0
    )
    for log, counts, got in logs:
        assert [r["rounds"] for r in log] == [1, 2, 3, 4]
        assert counts == {
            "allreduces": steps,  # the group's token count in its float64 collective
            "elements": steps * (_numel() + 1),
            "participants": [2] * 4,
        }
        assert_trees_all_close(got, params, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(300)
def test_outer_nesterov_every_three_steps_matches_a_simulation(tmp_path: Path) -> None:
    steps, inner_steps = 6, 3
    assert _run_groups(tmp_path, steps, inner_steps, outer="nesterov") == [0, 0]
    expected = _simulate(steps, inner_steps, 0.7, 0.9, rounds=[(0, 1), (0, 1)])
    (log0, counts0, got0), (log1, counts1, got1) = (_result(tmp_path, g) for g in (0, 1))
    assert [r["rounds"] for r in log0] == [r["rounds"] for r in log1] == [0, 0, 1, 1, 1, 2]
    # One all-reduce per round (one dtype), of every local param element and the tokens.
    elements = 2 * (_numel() + 1)
    assert counts0 == counts1 == {"allreduces": 2, "elements": elements, "participants": [2, 2]}
    for k in got0:
        assert torch.equal(got0[k], got1[k]), k  # every group goes on from the same params
    assert_trees_all_close(got0, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(300)
def test_a_warm_up_of_averaging_rounds_then_outer_nesterov_matches_a_simulation(
    tmp_path: Path,
) -> None:
    steps, inner_steps, warmup = 6, 2, 2
    assert _run_groups(tmp_path, steps, inner_steps, "nesterov", warmup=warmup) == [0, 0]
    expected = _simulate(steps, inner_steps, 0.7, 0.9, rounds=[(0, 1)] * 2, warmup=warmup)
    (log0, counts0, got0), (log1, counts1, got1) = (_result(tmp_path, g) for g in (0, 1))
    assert [r["rounds"] for r in log0] == [r["rounds"] for r in log1] == [1, 2, 2, 3, 3, 4]
    elements = 4 * (_numel() + 1)
    assert counts0 == counts1 == {"allreduces": 4, "elements": elements, "participants": [2] * 4}
    for k in got0:
        assert torch.equal(got0[k], got1[k]), k
    assert_trees_all_close(got0, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(300)
def test_a_round_a_group_dies_in_is_dropped_and_the_survivor_goes_on(tmp_path: Path) -> None:
    steps, inner_steps = 6, 2
    survivor_rc, victim_rc = _run_groups(tmp_path, steps, inner_steps, outer="nesterov", die=1)
    assert (survivor_rc, victim_rc) == (0, -9)
    log, counts, got = _result(tmp_path, 0)
    assert [r["step"] for r in log] == list(range(steps))  # no restart, none repeated
    assert [r["rounds"] for r in log] == [0, 1, 1, 1, 1, 2]  # round 1 not committed
    assert counts["participants"] == [2, 2, 1]
    expected = _simulate(steps, inner_steps, 0.7, 0.9, rounds=[(0, 1), None, (0,)])
    assert_trees_all_close(got, expected, rtol=1e-10, atol=1e-12)
    said = _said(tmp_path, "group0")
    assert said == [
        "diloco: a replica group failed during the outer round after inner step 4; round "
        "dropped, this group goes on from the last synced params",
        "diloco: 1 replica group(s) left; outer rounds continue on 1",
    ]


def _kill_and_restart(
    tmp_path: Path, steps: int, inner_steps: int, death: str, groups: int = 2
) -> None:
    """Groups 0 to ``groups - 1`` on a lighthouse that forms no quorum without all of them
    (``min_replicas=groups``); group 1 dies as ``death`` says (SIGKILL by itself), is
    restarted with ``--join``, and all run to their ends."""
    lighthouse = _lighthouse(min_replicas=groups)
    args = (f"--steps={steps}", f"--inner-steps={inner_steps}", "--outer=nesterov")
    try:
        survivors = [
            _start(lighthouse, tmp_path, f"group{g}", f"--group={g}", *args)
            for g in range(groups)
            if g != 1
        ]
        victim = _start(lighthouse, tmp_path, "group1", "--group=1", death, *args)
        for proc in [*survivors, victim]:
            _go(proc)
        assert victim.wait(timeout=240) == -9
        restarted = _start(lighthouse, tmp_path, "group1b", "--group=1", "--join", *args)
        _go(restarted)
        assert restarted.wait(timeout=240) == 0
        assert [proc.wait(timeout=240) for proc in survivors] == [0] * len(survivors)
    finally:
        lighthouse.shutdown()


def _said(tmp_path: Path, name: str) -> list[str]:
    """The ``diloco:`` lines the group ``name`` wrote to its stderr."""
    return [
        line for line in (tmp_path / f"{name}.err").read_text().splitlines() if "diloco:" in line
    ]


@pytest.mark.timeout(300)
def test_a_group_killed_inside_a_round_restarts_and_rejoins_bitwise(tmp_path: Path) -> None:
    # Rounds after inner steps 2, 4, 6, 8. Group 1 dies inside round 2 (the survivor's is
    # dropped) and restarts; no quorum forms with fewer than both groups (min_replicas=2), so
    # the survivor's round 3 waits for the restarted group, which heals there from the
    # survivor's state and takes part in it; round 4 runs on both groups' own batches.
    steps, inner_steps = 8, 2
    _kill_and_restart(tmp_path, steps, inner_steps, "--die-in-round=1")
    log, counts, got = _result(tmp_path, 0)
    assert [r["step"] for r in log] == list(range(steps))  # no restart, none repeated
    assert [r["rounds"] for r in log] == [0, 1, 1, 1, 1, 2, 2, 3]  # round 2 dropped
    assert counts["participants"] == [2, 2, 2, 2]
    rejoined, rejoined_counts, rejoined_got = _result(tmp_path, "1b")
    assert [(r["step"], r["rounds"]) for r in rejoined] == [(6, 2), (7, 3)]
    assert rejoined_counts["participants"] == [2, 2]  # the quorum it healed at, and round 4
    for k in got:
        assert torch.equal(got[k], rejoined_got[k]), k
    expected = _simulate(
        steps, inner_steps, 0.7, 0.9, rounds=[(0, 1), None, (0,), (0, 1)], rejoins={2: (1, 0)}
    )
    assert_trees_all_close(got, expected, rtol=1e-10, atol=1e-12)
    said = _said(tmp_path, "group1b")
    assert said == [
        "diloco: this replica group rejoined after outer round 1, at inner step 6, with a live "
        "peer's params, anchor and optimizer states"
    ]


@pytest.mark.timeout(300)
def test_a_group_killed_before_the_first_round_restarts_and_rejoins_bitwise(
    tmp_path: Path,
) -> None:
    # Rounds after inner steps 3 and 6. Group 1 dies before its inner step 1, inside the first
    # round's inner steps, and restarts while no round has committed: the survivor's count of
    # committed rounds is still 0, but the restarted group's is -1 until it steps, so torchft
    # heals it at the survivor's first round (min_replicas=2: that round waits for it), where
    # it takes part with the survivor's state; round 2 runs on both groups' own batches.
    steps, inner_steps = 6, 3
    _kill_and_restart(tmp_path, steps, inner_steps, "--die-at-step=1")
    log, counts, got = _result(tmp_path, 0)
    assert [r["step"] for r in log] == list(range(steps))  # no restart, none repeated
    assert [r["rounds"] for r in log] == [0, 0, 1, 1, 1, 2]  # both rounds committed
    assert counts["participants"] == [2, 2]
    rejoined, rejoined_counts, rejoined_got = _result(tmp_path, "1b")
    assert [(r["step"], r["rounds"]) for r in rejoined] == [(3, 1), (4, 1), (5, 2)]
    assert rejoined_counts["participants"] == [2, 2]  # the quorum it healed at, and round 2
    for k in got:
        assert torch.equal(got[k], rejoined_got[k]), k
    expected = _simulate(steps, inner_steps, 0.7, 0.9, rounds=[(0, 1), (0, 1)], rejoins={0: (1, 0)})
    assert_trees_all_close(got, expected, rtol=1e-10, atol=1e-12)
    said = _said(tmp_path, "group1b")
    assert said == [
        "diloco: this replica group rejoined after outer round 0, at inner step 3, with a live "
        "peer's params, anchor and optimizer states"
    ]


@pytest.mark.timeout(300)
def test_a_group_rejoining_among_three_weighs_nothing_in_its_round(tmp_path: Path) -> None:
    # Rounds after inner steps 2, 4, 6. Group 1 dies inside round 2 (dropped), restarts and
    # heals at round 3 from a live peer (torchft picks which): its pseudo-gradient is that
    # peer's, so it weighs 0 and round 3 averages groups 0 and 2 alone. Counted as a copy,
    # the peer would weigh twice: (2 g_peer + g_other) / 3.
    steps, inner_steps = 6, 2
    _kill_and_restart(tmp_path, steps, inner_steps, "--die-in-round=1", groups=3)
    got = {g: _result(tmp_path, g)[2] for g in ("0", "2", "1b")}
    for k in got["0"]:
        assert torch.equal(got["0"][k], got["2"][k]) and torch.equal(got["0"][k], got["1b"][k])
    expected = _simulate(steps, inner_steps, 0.7, 0.9, rounds=[(0, 1, 2), None, (0, 2)], groups=3)
    assert_trees_all_close(got["0"], expected, rtol=1e-10, atol=1e-12)
    said = _said(tmp_path, "group1b")
    assert said == [
        "diloco: this replica group rejoined after outer round 1, at inner step 6, with a live "
        "peer's params, anchor and optimizer states"
    ]
