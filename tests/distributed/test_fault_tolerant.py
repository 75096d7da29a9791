"""``d9d.fault_tolerant`` on a real torchft lighthouse: replica groups as processes of their own.

(a) Two replica groups, no failure: equal to one device fed both groups' batches (float64,
AdamW). (b) One group SIGKILLs itself after a step: the survivor keeps stepping without a
restart, its committed steps consecutive and none repeated, and its params equal one device
fed both batches up to the kill and the survivor's alone after it. (c) The killed group is
restarted and rejoins: it takes the survivor's live params and optimizer state at its first
quorum, both step on together, and their params and optimizer state end bitwise equal.
(d) A group of another layout that joins late is refused by name, and the survivor goes on.
(e) Two replica groups of pp=2 each (a pipeline inside each group, its ranks forked): equal to
one device fed both groups' batches while both live, and the survivor's alone after one is
killed; the restarted group rejoins, each rank taking its own stage's state from the same
rank of the survivor, and both end bitwise equal.

Every ordering is an event (a line on a pipe, a process's exit), none a sleep: see
``ft_replica.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from equivalence import llama, reference

from d9d.testing import assert_trees_all_close

torchft = pytest.importorskip("torchft")
from ft_replica import batch_of  # noqa: E402
from torchft.coordination import LighthouseServer  # noqa: E402

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent
STEPS = 4


def _lighthouse() -> LighthouseServer:
    # join_timeout: how long a quorum waits for a heartbeating group that has not asked yet
    # (never reached: both groups ask each step). heartbeat_timeout: how soon a dead group
    # stops counting as alive, the survivor's wait after a kill.
    return LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=60_000,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=2_000,
    )


def _start(
    lighthouse: LighthouseServer, group: int, out: Path, *extra: str, steps: int = STEPS
) -> subprocess.Popen:
    command = [
        sys.executable,
        str(HERE / "ft_replica.py"),
        f"--lighthouse={lighthouse.address()}",
        f"--group={group}",
        f"--steps={steps}",
        f"--out={out}",
        *extra,
    ]
    return subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=HERE
    )


def _expect(proc: subprocess.Popen, word: str) -> None:
    line = proc.stdout.readline().strip()
    assert line == word, f"replica group said {line!r}, not {word!r} (rc={proc.poll()})"


def _go(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()


def _finish(proc: subprocess.Popen, timeout: float = 240) -> None:
    proc.stdin.close()
    assert proc.wait(timeout=timeout) == 0


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def _reference(data: list[dict], n_layers: int = 1) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    return reference(llama(torch.float64, n_layers=n_layers), data)


def _both(step: int) -> dict:
    a, b = batch_of(0, step), batch_of(1, step)
    return {k: torch.cat([a[k], b[k]]) for k in a}


@pytest.mark.timeout(300)
def test_two_replica_groups_equal_one_device_fed_both(tmp_path: Path) -> None:
    lighthouse = _lighthouse()
    try:
        procs = [_start(lighthouse, g, tmp_path / f"group{g}.jsonl") for g in (0, 1)]
        for proc in procs:
            _expect(proc, "ready")
        _go(*procs)
        for proc in procs:
            _finish(proc)
    finally:
        lighthouse.shutdown()
    losses, params = _reference([_both(s) for s in range(STEPS)])
    for g in (0, 1):
        log = _log(tmp_path / f"group{g}.jsonl")
        assert [(r["step"], r["committed"], r["participants"]) for r in log] == [
            (s, True, 2) for s in range(STEPS)
        ]
        torch.testing.assert_close(
            torch.tensor([r["loss"] for r in log], dtype=torch.float64), losses, rtol=1e-12, atol=0
        )
        got = torch.load(tmp_path / f"group{g}.jsonl.params.pt")
        assert_trees_all_close(got, params, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(300)
def test_survivor_keeps_stepping_after_a_replica_group_is_killed(tmp_path: Path) -> None:
    killed_after = 1
    lighthouse = _lighthouse()
    try:
        survivor = _start(lighthouse, 0, tmp_path / "group0.jsonl", f"--pause-after={killed_after}")
        victim = _start(lighthouse, 1, tmp_path / "group1.jsonl", f"--die-after={killed_after}")
        for proc in (survivor, victim):
            _expect(proc, "ready")
        _go(survivor, victim)
        _expect(survivor, "paused")  # step `killed_after` committed by the survivor
        assert victim.wait(timeout=240) == -9  # SIGKILLed itself after committing it too
        killed = time.perf_counter()
        _go(survivor)
        _finish(survivor)
        print(
            f"kill to the survivor's end ({STEPS - killed_after - 1} steps): "
            f"{time.perf_counter() - killed:.2f} s"
        )
    finally:
        lighthouse.shutdown()
    log = _log(tmp_path / "group0.jsonl")
    committed = [r["step"] for r in log if r["committed"]]
    assert committed == list(range(STEPS))  # consecutive, none repeated, no restart
    assert [r["participants"] for r in log if r["committed"]] == [2] * (killed_after + 1) + [1] * (
        STEPS - killed_after - 1
    )
    victim_log = _log(tmp_path / "group1.jsonl")
    assert [r["step"] for r in victim_log] == list(range(killed_after + 1))
    data = [_both(s) for s in range(killed_after + 1)]
    data += [batch_of(0, s) for s in range(killed_after + 1, STEPS)]
    _, params = _reference(data)
    got = torch.load(tmp_path / "group0.jsonl.params.pt")
    assert_trees_all_close(got, params, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(300)
def test_a_killed_group_restarts_and_rejoins_bitwise(tmp_path: Path) -> None:
    # Steps 0-1 on both groups, step 2 on the survivor alone, steps 3-4 on both again.
    steps = 5
    lighthouse = _lighthouse()
    try:
        survivor = _start(
            lighthouse,
            0,
            tmp_path / "group0.jsonl",
            "--pause-after=1,2",
            "--wait-at=3",
            steps=steps,
        )
        victim = _start(lighthouse, 1, tmp_path / "group1.jsonl", "--die-after=1", steps=steps)
        for proc in (survivor, victim):
            _expect(proc, "ready")
        _go(survivor, victim)
        _expect(survivor, "paused")  # step 1 committed
        assert victim.wait(timeout=240) == -9
        _go(survivor)
        _expect(survivor, "paused")  # step 2 committed alone
        restarted = _start(lighthouse, 1, tmp_path / "group1b.jsonl", steps=steps)
        _expect(restarted, "ready")
        restart = time.perf_counter()
        _go(survivor, restarted)
        _finish(restarted)
        print(
            f"restart to the rejoined group's end ({steps - 3} steps): "
            f"{time.perf_counter() - restart:.2f} s"
        )
        _finish(survivor)
    finally:
        lighthouse.shutdown()
    log = _log(tmp_path / "group0.jsonl")
    assert [r["step"] for r in log if r["committed"]] == list(range(steps))
    assert [r["participants"] for r in log if r["committed"]] == [2, 2, 1, 2, 2]
    rejoined = _log(tmp_path / "group1b.jsonl")
    assert [(r["step"], r["committed"], r["participants"]) for r in rejoined] == [
        (3, True, 2),
        (4, True, 2),
    ]
    for suffix in (".params.pt", ".opt_state.pt"):
        a = torch.load(tmp_path / f"group0.jsonl{suffix}")
        b = torch.load(tmp_path / f"group1b.jsonl{suffix}")
        pairs = (
            zip(a.values(), b.values(), strict=True)
            if isinstance(a, dict)
            else zip(a, b, strict=True)
        )
        assert all(torch.equal(x, y) for x, y in pairs), suffix
    data = [_both(0), _both(1), batch_of(0, 2), _both(3), _both(4)]
    _, params = _reference(data)
    got = torch.load(tmp_path / "group1b.jsonl.params.pt")
    assert_trees_all_close(got, params, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(300)
def test_a_late_group_of_another_layout_is_refused_and_the_survivor_goes_on(
    tmp_path: Path,
) -> None:
    steps = 4
    lighthouse = _lighthouse()
    try:
        survivor = _start(
            lighthouse, 0, tmp_path / "group0.jsonl", "--pause-after=1", "--wait-at=2", steps=steps
        )
        _expect(survivor, "ready")
        _go(survivor)
        _expect(survivor, "paused")  # steps 0-1 committed alone
        late = subprocess.Popen(
            [
                *(sys.executable, str(HERE / "ft_replica.py"), "--group=1", "--axis=dp"),
                *(f"--lighthouse={lighthouse.address()}", f"--steps={steps}"),
                f"--out={tmp_path / 'group1.jsonl'}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=HERE,
        )
        _expect(late, "ready")
        _go(late, survivor)
        _, err = late.communicate(timeout=240)
        assert late.returncode != 0
        assert "PlanError: this replica group cannot rejoin: its live peer's params" in err
        assert "on mesh (fsdp=1)" in err and "on mesh (dp=1)" in err
        _finish(survivor)
    finally:
        lighthouse.shutdown()
    log = _log(tmp_path / "group0.jsonl")
    assert [r["step"] for r in log if r["committed"]] == list(range(steps))


@pytest.mark.timeout(300)
def test_pipelined_replica_groups_equal_one_device_and_a_killed_one_rejoins_bitwise(
    tmp_path: Path,
) -> None:
    # Each group is two forked ranks, one stage each; rank r of one group all-reduces its
    # stage's grads with rank r of the other, and a restarted rank r takes rank r's state.
    # Forked ranks read no stdin, so the ordering is the lighthouse's: the groups meet at
    # step 0 (--wait-at 0), group 1 dies after committing step 1, the survivor waits at step
    # 3 for the restarted group, which rejoins at step 2 or 3, whenever its quorum meets the
    # survivor's (so each step's data is read from the survivor's log).
    steps = 5
    lighthouse = _lighthouse()
    try:
        survivor = _start(
            lighthouse, 0, tmp_path / "group0.jsonl", "--pp=2", "--wait-at=0,3", steps=steps
        )
        victim = _start(
            lighthouse, 1, tmp_path / "group1.jsonl", "--pp=2", "--wait-at=0", "--die-after=1"
        )
        assert victim.wait(timeout=240) != 0  # its ranks SIGKILLed themselves
        restarted = _start(
            lighthouse, 1, tmp_path / "group1b.jsonl", "--pp=2", "--wait-at=0", steps=steps
        )
        _finish(restarted)
        _finish(survivor)
    finally:
        lighthouse.shutdown()
    log = _log(tmp_path / "group0.jsonl")
    assert [r["step"] for r in log if r["committed"]] == list(range(steps))
    both = [r["participants"] == 2 for r in log if r["committed"]]
    assert both[:2] == [True, True] and both[3:] == [True, True]
    data = [_both(s) if two else batch_of(0, s) for s, two in enumerate(both)]
    losses, params = _reference(data, n_layers=2)
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in log if r["committed"]], dtype=torch.float64),
        losses,
        rtol=1e-12,
        atol=0,
    )
    rejoined = _log(tmp_path / "group1b.jsonl")
    assert rejoined[0]["step"] in (2, 3) and rejoined[-1]["step"] == steps - 1
    assert all(r["committed"] and r["participants"] == 2 for r in rejoined)
    stages = []
    for rank in (0, 1):  # the restarted group's state equals the survivor's, bit for bit
        for suffix in (".params.pt", ".opt_state.pt"):
            a = torch.load(tmp_path / f"group0.jsonl.rank{rank}{suffix}")
            b = torch.load(tmp_path / f"group1b.jsonl.rank{rank}{suffix}")
            a, b = (list(a.values()), list(b.values())) if isinstance(a, dict) else (a, b)
            assert len(a) == len(b) and all(map(torch.equal, a, b)), suffix
        stages.append(torch.load(tmp_path / f"group1b.jsonl.rank{rank}.params.pt"))
    assert not set(stages[0]) & set(stages[1])  # each rank holds its own stage
    assert_trees_all_close({**stages[0], **stages[1]}, params, rtol=1e-10, atol=1e-12)
