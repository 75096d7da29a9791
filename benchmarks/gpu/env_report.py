"""The machine the GPU suite runs on, as a JSON report: the suite's ``env`` stage.

Python, torch and its CUDA, the device (name, capability, memory), the CPU count, and the
version of each package a stage uses, or why it does not import (a wheel not carried, a
dependency missing). Fails (exit 1) only where d9d itself does not import.

    python benchmarks/gpu/env_report.py --out /tmp/env.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

# (import name, distribution name): what the stages import, directly or through d9d.
PACKAGES = (
    ("d9d", "d9d"),
    ("triton", "triton"),
    ("transformers", "transformers"),
    ("optree", "optree"),
    ("google_crc32c", "google-crc32c"),
    ("tensorstore", "tensorstore"),
    ("liger_kernel", "liger-kernel"),
    ("torchtitan.models.llama3", "torchtitan"),
    ("pytest", "pytest"),
    ("xdist", "pytest-xdist"),
    ("pytest_timeout", "pytest-timeout"),
)


def _package(module: str, distribution: str) -> dict[str, Any]:
    try:
        importlib.import_module(module)
    except Exception as error:  # any import failure is a fact about the machine
        return {"import": module, "error": f"{type(error).__name__}: {error}"[:300]}
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "from the checkout"  # d9d on PYTHONPATH
    return {"import": module, "version": version}


def _device() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"device": "cpu", "cuda": None}
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "cuda": torch.version.cuda,
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "device_count": torch.cuda.device_count(),
    }


def _commit() -> str | None:
    """The checkout's short commit; None where git or its metadata is missing (a copied tree)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return None
    return done.stdout.strip() or None


def report() -> dict[str, Any]:
    """The environment: every field a summary's header names, and each package's state."""
    packages = {dist: _package(module, dist) for module, dist in PACKAGES}
    return {
        "benchmark": "env",
        **_device(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python_path": os.environ.get("PYTHONPATH", ""),
        "packages": packages,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    env = report()
    for name, package in env["packages"].items():
        print(json.dumps({"package": name, **package}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(env, indent=2) + "\n")
    print(f"{env['device']} (CUDA {env['cuda']}), torch {env['torch']}, Python {env['python']}")
    return 1 if "error" in env["packages"]["d9d"] else 0


if __name__ == "__main__":
    sys.exit(main())
