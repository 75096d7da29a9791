"""Runs pytest and writes its outcome as a JSON report: the GPU suite's ``jit`` stage.

Each test's outcome is printed as a JSON line the moment pytest reports it (pytest-xdist
workers' results included), so a run cut off by its budget still records what finished; the
report at the end holds them all with pytest's exit code.

    python benchmarks/gpu/run_tests.py --out /tmp/jit.json -- -n 0 tests/core/test_jit.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

_MESSAGE_CHARS = 600  # of a failure's text: its last lines, where the assertion is


class Recorder:
    """A pytest plugin keeping one row per test: the call's outcome, or setup's if it failed."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" and report.outcome == "passed":
            return  # setup and teardown that passed say nothing
        outcome = "error" if report.when != "call" and report.failed else report.outcome
        row: dict[str, Any] = {
            "test": report.nodeid,
            "outcome": outcome,
            "seconds": round(report.duration, 2),
        }
        if report.failed or report.skipped:
            row["message"] = _message(report)
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def _message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])  # (file, line, reason)
    return report.longreprtext[-_MESSAGE_CHARS:]


def _device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON report")
    parser.add_argument("pytest_args", nargs="+", help="after --: pytest's arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    recorder = Recorder()
    start = time.perf_counter()
    code = int(pytest.main(["-p", "no:cacheprovider", *args.pytest_args], plugins=[recorder]))
    counts: dict[str, int] = {}
    for row in recorder.rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    report = {
        "benchmark": "jit",
        "device": _device(),
        "torch": torch.__version__,
        "command": " ".join(["pytest", *args.pytest_args]),
        "exit_code": code,
        "seconds": round(time.perf_counter() - start, 1),
        "counts": counts,
        "tests": recorder.rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
