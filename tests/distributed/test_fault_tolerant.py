"""``d9d.fault_tolerant`` on a real torchft lighthouse: replica groups as processes of their own.

(a) Two replica groups, no failure: equal to one device fed both groups' batches (float64,
AdamW). (b) One group SIGKILLs itself after a step: the survivor keeps stepping without a
restart, its committed steps consecutive and none repeated, and its params equal one device
fed both batches up to the kill and the survivor's alone after it.

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


def _start(lighthouse: LighthouseServer, group: int, out: Path, *extra: str) -> subprocess.Popen:
    command = [
        sys.executable,
        str(HERE / "ft_replica.py"),
        f"--lighthouse={lighthouse.address()}",
        f"--group={group}",
        f"--steps={STEPS}",
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


def _reference(data: list[dict]) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    return reference(llama(torch.float64, n_layers=1), data)


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
def test_a_group_started_behind_the_others_is_refused_by_name(tmp_path: Path) -> None:
    # Rejoining (the live params copied from a peer) is not built: a late group must fail,
    # not train on its initial params beside the others.
    lighthouse = _lighthouse()
    try:
        early = _start(lighthouse, 0, tmp_path / "group0.jsonl", "--pause-after=1")
        _expect(early, "ready")
        _go(early)
        _expect(early, "paused")  # two steps committed alone
        late = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "ft_replica.py"),
                f"--lighthouse={lighthouse.address()}",
                "--group=1",
                f"--steps={STEPS}",
                f"--out={tmp_path / 'group1.jsonl'}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=HERE,
        )
        _expect(late, "ready")
        _go(late, early)  # the late group's first quorum holds both
        _, err = late.communicate(timeout=240)
        assert late.returncode != 0
        assert (
            "rejoining (the live params and optimizer state copied from a peer) is not built" in err
        )
        _finish(early)
    finally:
        lighthouse.shutdown()
    log = _log(tmp_path / "group0.jsonl")
    assert [r["step"] for r in log if r["committed"]] == list(range(STEPS))
