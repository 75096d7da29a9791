"""benchmarks/report.py: the command a result JSON records parses back to the same options
(benchmarks/results/fsdp_overhead-cpu.json once recorded ``--jit False``, which argparse
refuses for a ``store_true`` flag)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(load_benchmark):
    return load_benchmark("report")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--jit", action="store_true")
    parser.add_argument("--outer", nargs="+", default=["0.7:0.9", "1:0"])
    parser.add_argument("--dir", default=None)
    return parser


@pytest.mark.parametrize(
    "argv",
    [[], ["--jit"], ["--seq-len", "0", "--outer", "1:0"], ["--dir", "/tmp/x", "--jit"]],
    ids=["defaults", "store_true", "zero-and-one-item", "path"],
)
def test_the_recorded_command_parses_back_to_the_same_options(report, argv) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    command = report.provenance("fsdp_overhead", args, "cpu")["command"]
    words = shlex.split(command)
    assert words[:2] == ["python", "benchmarks/fsdp_overhead.py"]
    assert parser.parse_args(words[2:]) == args
    assert "False" not in words and "None" not in words


@pytest.mark.parametrize(
    "script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")), ids=str
)
def test_a_printed_table_names_the_unit_it_divides_by(script) -> None:
    """MB is 1e6 bytes and MiB 2**20: fsdp_overhead, zero and tp_cp printed ``(MB)`` over
    bytes / 2**20, and docs/benchmarks.md copied the label."""
    source = (ROOT / "benchmarks" / script).read_text()
    if "/ 2**20" in source:
        assert "(MB" not in source, f"{script} divides by 2**20 but labels a column MB"
    if "/ 1e6" in source:
        assert "(MiB" not in source, f"{script} divides by 1e6 but labels a column MiB"
