"""A replica group's failure and rejoin under ``d9d train --fault-tolerant``, timed on CPU gloo.

Per ``--presets`` entry: a torchft lighthouse (``--heartbeat-ms``) and two replica groups,
each one ``python -m d9d train`` process (``--steps`` far beyond the run, ``--log-every 1``).
Once group 1 has logged ``--warm`` steps it is SIGKILLed, and the survivor's files are
watched (polled every 10 ms):

  kill_to_next_step_s   kill -> the survivor's first committed step on the one group left
                        (its metrics record after its "replica group(s) left" line)
  restart_to_rejoin_s   restart of group 1 (the same command) -> its "rejoined" line
                        (process start, imports, model build, quorum, state transfer)
  restart_to_step_s     restart -> the restarted group's first committed step
  served_mib            the params and AdamW state one rank receives (fp32)

With ``--diloco H`` the groups train as DiLoCo replica groups (outer rounds every H steps, the
default outer Nesterov), group 1 is killed once it logged ``--warm`` steps (more than H: the
survivor first counts the groups at a committed round), and the times are the rounds':

  kill_to_next_round_s  kill -> the survivor's first committed outer round on the one group
                        left (its "replica group(s) left" line, logged at that commit)
  restart_to_rejoin_s   restart of group 1 -> its "rejoined after outer round" line (healed
                        at the survivor's next round's quorum)
  restart_to_round_s    restart -> the restarted group's first committed round (the
                        survivor's "replica group(s) joined" line, logged as that round,
                        run by both, commits)
  served_mib            params, AdamW state, anchor and outer momentum one rank receives

Each time is the median of ``--repeats`` runs (a fresh lighthouse and groups each); every
run's times are kept beside it. The machine's 1-minute load average is recorded: on a shared
machine the restart (process start, imports) varies most.

    python benchmarks/ft_rejoin.py --out benchmarks/results/ft_rejoin-cpu.json
    python benchmarks/ft_rejoin.py --diloco 4 --out benchmarks/results/ft_rejoin-diloco-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from report import device_name, provenance, write_report
from torchft.coordination import LighthouseServer

from d9d.models import LlamaConfig

_POLL_S = 0.01


def _records(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _when(ready: Callable[[], Any], procs: list[subprocess.Popen], timeout_s: float = 600) -> Any:
    """Poll ``ready`` until it returns something truthy; fail if a process exits."""
    deadline = time.monotonic() + timeout_s
    while not (found := ready()):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"a replica group exited or hung ({[p.poll() for p in procs]})")
        time.sleep(_POLL_S)
    return found


def _group(args: argparse.Namespace, preset: str, lighthouse: str, group: int, work: Path):
    out, log = work / f"{preset}-group{group}", work / f"{preset}-group{group}.log"
    steps = 1_000_000 * (args.diloco or 1)  # far beyond the run (a multiple of --diloco)
    command = [
        *(sys.executable, "-m", "d9d", "train", "--preset", preset, "--no-tensorboard"),
        *("--steps", str(steps), "--log-every", "1", "--batch-size", str(args.batch_size)),
        *("--seq-len", str(args.seq_len), "--fault-tolerant", f"--lighthouse={lighthouse}"),
        *("--replica-groups", "2", f"--replica-group-id={group}", f"--out={out}"),
        *(("--diloco", str(args.diloco)) if args.diloco else ()),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(command, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT)
    return proc, out, log


def _served_mib(preset: str, diloco: bool) -> float:
    config = LlamaConfig.preset(preset)
    from d9d.models import Llama

    n = sum(p.numel() for p in Llama(config, device="meta").parameters())
    # fp32 params, AdamW's two moments; under DiLoCo the anchor and the outer momentum too
    return round((5 if diloco else 3) * 4 * n / 2**20, 2)


def _times(args: argparse.Namespace) -> tuple[str, ...]:
    if args.diloco:
        return ("kill_to_next_round_s", "restart_to_rejoin_s", "restart_to_round_s")
    return ("kill_to_next_step_s", "restart_to_rejoin_s", "restart_to_step_s")


def _logged(log: Path, line: str) -> Callable[[], bool]:
    return lambda: line in log.read_text()


def median_row(args: argparse.Namespace, preset: str, work: Path) -> dict[str, Any]:
    """``run_preset`` ``--repeats`` times: the median of each time, and every run's."""
    runs = [run_preset(args, preset, work / f"run{i}") for i in range(args.repeats)]
    row = dict(runs[0])
    times = _times(args)
    for key in (*times, "step_time_s", "load_1min"):
        row[key] = statistics.median(r[key] for r in runs)
    row["runs"] = [{k: r[k] for k in (*times, "load_1min")} for r in runs]
    return row


def run_preset(args: argparse.Namespace, preset: str, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True)
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=60_000,
        heartbeat_timeout_ms=args.heartbeat_ms,
    )
    procs: list[subprocess.Popen] = []
    try:
        survivor, out0, log0 = _group(args, preset, lighthouse.address(), 0, work)
        victim, out1, _ = _group(args, preset, lighthouse.address(), 1, work)
        procs = [survivor, victim]
        _when(lambda: len(_records(out1)) >= args.warm, procs)
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        victim.wait()
        procs = [survivor]
        _when(_logged(log0, "replica group(s) left"), procs)
        if not args.diloco:  # the step after that line
            seen = len(_records(out0))
            _when(lambda: len(_records(out0)) > seen, procs)
        next_step = time.monotonic() - killed
        last = _records(out1)[-1]["step"]
        restarted, _, log1 = _group(args, preset, lighthouse.address(), 1, work)
        restart = time.monotonic()
        procs = [survivor, restarted]
        _when(
            _logged(log1, "rejoined after outer round" if args.diloco else "rejoined at step"),
            procs,
        )
        rejoined = time.monotonic() - restart
        if args.diloco:
            _when(_logged(log0, "replica group(s) joined"), procs)
        else:
            _when(lambda: any(r["step"] > last for r in _records(out1)), procs)
        first_step = time.monotonic() - restart
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        lighthouse.shutdown()
    kill_to, rejoin, first = _times(args)
    row = {
        "preset": preset,
        kill_to: round(next_step, 2),
        rejoin: round(rejoined, 2),
        first: round(first_step, 2),
        "served_mib": _served_mib(preset, bool(args.diloco)),
        "step_time_s": round(_records(out0)[-1]["step_time_s"], 4),
        "load_1min": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(row))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per group")
    parser.add_argument("--heartbeat-ms", type=int, default=2000)
    parser.add_argument(
        "--warm",
        type=int,
        help="steps group 1 logs before the kill (default 3; H + 2 under --diloco H)",
    )
    parser.add_argument("--diloco", type=int, help="DiLoCo groups, an outer round every H steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ft_rejoin-cpu.json"))
    args = parser.parse_args()
    if args.warm is None:
        args.warm = args.diloco + 2 if args.diloco else 3
    if args.diloco and args.warm <= args.diloco:
        parser.error(
            f"--warm {args.warm} must exceed --diloco {args.diloco}: the survivor counts the "
            "groups at its first committed round, and says one left only at a later one"
        )
    header = provenance("ft_rejoin", args, device_name(), backend="gloo")
    header |= {"cpus": os.cpu_count(), "load_1min_before": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory() as work:
        rows = [median_row(args, p, Path(work) / p) for p in args.presets.split(",")]
    write_report(args.out, {**header, "rows": rows})


if __name__ == "__main__":
    main()
