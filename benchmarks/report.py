"""What every benchmark's JSON starts with (what ran, where, at which commit), and writing it.

The scripts run as ``python benchmarks/<name>.py``, so this directory is on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def device_name() -> str:
    """The device the benchmark runs on: the GPU's name, else the CPU's architecture."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.machine()})"


def provenance(name: str, args: argparse.Namespace, device: str, **extra: str) -> dict[str, Any]:
    """The header of ``benchmarks/results/<name>-*.json``: the benchmark, the device, torch,
    the commit and the command that reproduces the run (every option, defaults included).

    Options whose value is None or False are left out of the command, a True one is the bare
    flag (``action="store_true"``), and a list's items follow its flag (``nargs``), so that
    the command parses again. ``extra`` (a backend, a library's version) follows the device.

    Example:
        >>> header = provenance("tp_cp", argparse.Namespace(seq_len=256), "cpu", backend="gloo")
        >>> header["command"], header["backend"]
        ('python benchmarks/tp_cp.py --seq-len 256', 'gloo')
    """
    options = " ".join(
        _option(key.replace("_", "-"), value)
        for key, value in vars(args).items()
        if value is not None and value is not False
    )
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {
        "benchmark": name,
        "device": device,
        **extra,
        "torch": torch.__version__,
        "commit": done.stdout.strip() or "unknown",
        "command": f"python benchmarks/{name}.py {options}".rstrip(),
    }


def _option(flag: str, value: Any) -> str:
    """``--flag value`` as argparse reads it back: a bare flag for True, items for a list."""
    if value is True:
        return f"--{flag}"
    if isinstance(value, (list, tuple)):
        return " ".join((f"--{flag}", *map(str, value)))
    return f"--{flag} {value}"


def significant(value: float, digits: int = 4) -> float:
    """``value`` rounded to ``digits`` significant figures: a ratio or a time keeps the same
    relative precision whether it is 40 or 0.007 (a fixed count of decimals would not).

    Example:
        >>> significant(0.006857075958840821), significant(1234.5678)
        (0.006857, 1235.0)
    """
    return float(f"{value:.{digits}g}")


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` as indented JSON at ``path``, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
