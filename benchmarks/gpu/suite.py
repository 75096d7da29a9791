"""The GPU suite's driver: every stage of ``stages.STAGES`` in order, each a process under
``timeout`` with its own budget, then ``summary.md``. ``run.sh`` is its front door (it
installs the carried wheels first and keeps the log).

A stage that fails or runs out of time is recorded in its JSON (``suite.status``, the
error, the last lines it printed, the result rows it printed so far) and the next one runs.
Exit status 0 only when every stage succeeded.

    python benchmarks/gpu/suite.py OUT_DIR [--smoke] [--only env,kernels] [--budget mfu=300]
        [--total 540]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import summary
from stages import SMOKE_BUDGET_S, STAGES, Stage

ROOT = Path(__file__).resolve().parents[2]
_KILL_AFTER_S = 10  # after the budget's SIGTERM, SIGKILL
_TAIL_LINES = 25  # of a failed stage's output, kept in its record
_TIMED_OUT = (124, 137)  # timeout's status: SIGTERM'd in time, or killed after --kill-after
# Each call of stages.CALLS budgets at most 510 s; this cap keeps a call whose stages each ran a
# little past theirs (up to _KILL_AFTER_S) inside one 10-minute command, with the install.
TOTAL_S = 540.0
_LEAST_S = 5.0  # a stage given less is not started


def json_rows(lines: list[str]) -> list[dict]:
    """The JSON objects among printed ``lines`` (a row may follow pytest's progress dots)."""
    rows = []
    for line in lines:
        start = line.find("{")
        if start < 0 or not line.rstrip().endswith("}"):
            continue
        try:
            row = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _echo(stream, lines: list[str]) -> None:
    for line in stream:
        print(line, end="", flush=True)
        lines.append(line)


def run_stage(stage: Stage, out_dir: Path, *, smoke: bool, budget_s: float) -> dict:
    """Runs ``stage`` under ``timeout budget_s``, writes ``<out_dir>/<name>.json`` with the
    suite's record added, and returns that report."""
    out = out_dir / f"{stage.name}.json"
    out.unlink(missing_ok=True)
    words = shlex.split(stage.smoke if smoke else stage.gpu)
    argv = [word.replace("{out}", str(out)) for word in words]
    command = ["timeout", f"--kill-after={_KILL_AFTER_S}", f"{budget_s:g}", sys.executable, *argv]
    shown = shlex.join(["python3", *argv])
    print(f"\n=== {stage.name}: {stage.what} (budget {budget_s:g} s)\n$ {shown}", flush=True)
    start = time.perf_counter()
    # errors="replace": one undecodable byte (a compiler's message) must not stop the reader,
    # which would leave the stage blocked on a full pipe until its budget ran out.
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    lines: list[str] = []
    reader = threading.Thread(target=_echo, args=(process.stdout, lines), daemon=True)
    reader.start()
    code = process.wait()
    reader.join(timeout=_KILL_AFTER_S)  # a stray grandchild may hold the pipe open
    record = {
        "status": "ok",
        "exit_code": code,
        "seconds": round(time.perf_counter() - start, 1),
        "budget_s": budget_s,
        "command": shown,
    }
    try:
        report = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError):
        report = None
    if code in _TIMED_OUT:
        record["status"] = "timed out"
        record["error"] = f"stopped after its budget of {budget_s:g} s"
    elif code != 0 or report is None:
        record["status"] = "failed"
        printed = [line.strip() for line in lines if line.strip()]
        if code == 0:
            record["error"] = f"exited 0 without writing {out.name}"
        else:
            record["error"] = printed[-1] if printed else f"exit status {code}, no output"
    if record["status"] != "ok":
        record["output_tail"] = "".join(lines[-_TAIL_LINES:])
    if report is None:
        report = {"benchmark": stage.name, "partial_rows": json_rows(lines)}
    report["suite"] = record
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"=== {stage.name}: {record['status']} in {record['seconds']} s", flush=True)
    return report


def _budgets(overrides: list[str], smoke: bool) -> dict[str, float]:
    budgets = {s.name: SMOKE_BUDGET_S if smoke else s.budget_s for s in STAGES}
    for override in overrides:
        name, _, seconds = override.partition("=")
        if name not in budgets:
            raise SystemExit(
                f"--budget {override!r}: no stage {name!r}; stages are {list(budgets)}"
            )
        try:
            budgets[name] = float(seconds)
        except ValueError:
            raise SystemExit(f"--budget {override!r}: give seconds, e.g. {name}=120") from None
    return budgets


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path, help="where the JSON reports and summary.md go")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, in minutes")
    parser.add_argument("--only", default="", help="comma-separated stages (default: all)")
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="STAGE=SECONDS",
        help="another budget for a stage (repeatable)",
    )
    parser.add_argument(
        "--total",
        type=float,
        default=None,
        help=f"seconds for all stages: each gets at most what is left (default {TOTAL_S:g} on "
        "a GPU, none with --smoke)",
    )
    return parser


def _not_run(stage: Stage, out_dir: Path, total_s: float) -> dict:
    """The record of a stage left out because the suite's ``--total`` was spent."""
    error = f"not run: less than {_LEAST_S:g} s was left of the suite's {total_s:g} s"
    report = {"benchmark": stage.name, "suite": {"status": "not run", "error": error}}
    (out_dir / f"{stage.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n=== {stage.name}: {error}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    names = [s.name for s in STAGES]
    only = [name for name in args.only.split(",") if name] or names
    unknown = [name for name in only if name not in names]
    if unknown:
        raise SystemExit(f"--only names unknown stages {unknown}: stages are {names}")
    budgets = _budgets(args.budget, args.smoke)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with _stage_environment():
        return _run(args, only, budgets)


@contextlib.contextmanager
def _stage_environment() -> Iterator[None]:
    """The stages' environment while the suite runs: unbuffered output and one inductor cache
    for every stage (the profile stage's step is the mfu stage's, cached), a temporary folder
    removed at the end unless ``TORCHINDUCTOR_CACHE_DIR`` names one. ``os.environ`` is as it
    was afterwards: in-process callers (the tests) used to keep one ``d9d-gpu-inductor-*``
    folder per call in the temporary directory."""
    saved = {name: os.environ.get(name) for name in ("TORCHINDUCTOR_CACHE_DIR", "PYTHONUNBUFFERED")}
    with tempfile.TemporaryDirectory(prefix="d9d-gpu-inductor-") as cache:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
        os.environ["PYTHONUNBUFFERED"] = "1"
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _run(args: argparse.Namespace, only: list[str], budgets: dict[str, float]) -> int:
    """The stages in ``only``, each under its budget, then the summary; 0 when all were ok."""
    total_s = args.total or (None if args.smoke else TOTAL_S)
    deadline = time.monotonic() + (total_s or float("inf"))
    reports = {}
    for stage in STAGES:
        if stage.name not in only:
            continue
        budget_s = min(budgets[stage.name], round(deadline - time.monotonic(), 1))
        if budget_s < _LEAST_S:
            reports[stage.name] = _not_run(stage, args.out_dir, total_s)
            continue
        reports[stage.name] = run_stage(stage, args.out_dir, smoke=args.smoke, budget_s=budget_s)
    text = summary.render(reports)
    (args.out_dir / "summary.md").write_text(text)
    print("\n" + text, flush=True)
    failed = [name for name, report in reports.items() if report["suite"]["status"] != "ok"]
    print(f"stages not ok: {failed}" if failed else "every stage ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
