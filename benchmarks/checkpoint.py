"""Checkpoint save and restore: d9d (tensorstore/zarr v3) against torch.distributed.checkpoint.

The state is the params of a Llama with Llama 3.2 1B block shapes (``--layers`` blocks,
vocab cut to ``--vocab``), fp32, sharded ``Shard(0)`` over ``fsdp=--world`` gloo ranks
(forked processes on CPU). Variants, each timed as the median over ``--repeats`` after
one untimed warm-up, and taken on the slowest rank:

  save      d9d async (blocked = until ``save`` returns; total = until committed),
            d9d sync, DCP sync (``dcp.save``), DCP async (``dcp.async_save``, thread).
  restore   into the saving layout (``Shard(0)``) and resharded (``Shard(1)``), d9d and DCP.

GB/s are global state bytes over wall time. Both libraries fsync their files
(tensorstore ``file_io_sync``, DCP ``sync_files``); restores read a warm page cache.

    python benchmarks/checkpoint.py --out benchmarks/results/checkpoint-cpu.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from report import provenance, write_report
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from d9d import checkpoint
from d9d.models import Llama, LlamaConfig
from d9d.testing import run_on_ranks


def _config(layers: int, vocab: int) -> LlamaConfig:
    return LlamaConfig.llama_1b(n_layers=layers, vocab_size=vocab)


def _state(config: LlamaConfig, world: int, dim: int) -> dict[str, Any]:
    """This rank's shards of the model params, laid out ``Shard(dim)`` (1-d leaves: dim 0)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    params = Llama(config, device="meta").named_parameters()
    out = {}
    for i, (path, meta) in enumerate(params):
        full = torch.full(meta.shape, float(i))
        out[path] = distribute_tensor(full, mesh, [Shard(min(dim, full.ndim - 1))])
    return out


def _slowest(seconds: float) -> float:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seconds)
    return max(gathered)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _rank(args: argparse.Namespace, root: str) -> dict[str, list[float]]:
    torch.manual_seed(0)
    config = _config(args.layers, args.vocab)
    state = _state(config, args.world, 0)
    times: dict[str, list[float]] = {}
    counter = iter(range(10**6))

    def record(name: str, seconds: float, repeat: int) -> None:
        if repeat:  # repeat 0 is the warm-up
            times.setdefault(name, []).append(_slowest(seconds))

    def fresh(tag: str) -> str:
        folder = f"{root}/{tag}-{next(counter)}"
        dist.barrier()
        return folder

    for repeat in range(args.repeats + 1):
        folder = fresh("d9d-async")
        dist.barrier()
        start = time.perf_counter()
        handle = checkpoint.save(folder, {"params": state}, step=1)
        blocked = time.perf_counter() - start
        handle.wait()
        record("d9d async save: blocked", blocked, repeat)
        record("d9d async save: total", time.perf_counter() - start, repeat)
        d9d_path = handle.path

        folder = fresh("d9d-sync")
        seconds, _ = _timed(
            functools.partial(checkpoint.save, folder, {"params": state}, step=1, async_=False)
        )
        record("d9d sync save", seconds, repeat)

        dcp_path = fresh("dcp-sync")
        seconds, _ = _timed(functools.partial(dcp.save, {"params": state}, checkpoint_id=dcp_path))
        record("dcp sync save", seconds, repeat)

        folder = fresh("dcp-async")
        dist.barrier()
        start = time.perf_counter()
        future = dcp.async_save({"params": state}, checkpoint_id=folder)
        blocked = time.perf_counter() - start
        future.result()
        record("dcp async save: blocked", blocked, repeat)
        record("dcp async save: total", time.perf_counter() - start, repeat)

        for name, dim in (("same layout", 0), ("resharded", 1)):
            target = {"params": _state(config, args.world, dim)}
            seconds, _ = _timed(functools.partial(checkpoint.restore, d9d_path, target))
            record(f"d9d restore, {name}", seconds, repeat)
            seconds, _ = _timed(functools.partial(dcp.load, target, checkpoint_id=dcp_path))
            record(f"dcp restore, {name}", seconds, repeat)
        dist.barrier()
        if dist.get_rank() == 0:
            for entry in Path(root).iterdir():
                shutil.rmtree(entry)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: /tmp)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/checkpoint-cpu.json"))
    args = parser.parse_args()
    config = _config(args.layers, args.vocab)
    state_bytes = 4 * sum(p.numel() for p in Llama(config, device="meta").parameters())
    root = tempfile.mkdtemp(prefix="d9d-ckpt-bench-", dir=args.dir)
    try:
        times = run_on_ranks(_rank, args.world, args, root, method="fork", timeout=3600)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = []
    for name, values in times.items():
        median = statistics.median(values)
        row = {"variant": name, "median_s": round(median, 4), "min_s": round(min(values), 4)}
        if "blocked" not in name:
            row["GB_per_s"] = round(state_bytes / median / 1e9, 3)
        results.append(row)
    report = {
        **provenance(
            "checkpoint",
            args,
            f"cpu ({platform.machine()}, {args.world} gloo ranks by fork, 1 thread each)",
            tensorstore=importlib.metadata.version("tensorstore"),
        ),
        "config": {
            "model": f"Llama 3.2 1B shapes, {args.layers} block(s), vocab {args.vocab}",
            "params": state_bytes // 4,
            "state_bytes": state_bytes,
            "layout": f"Shard(0) over fsdp={args.world}; resharded restore into Shard(1)",
            "scratch": str(args.dir or tempfile.gettempdir()),
        },
        "results": results,
    }
    write_report(args.out, report)
    print(f"state: {state_bytes / 1e6:.0f} MB\n| variant | median (s) | GB/s |\n|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['median_s']} | {r.get('GB_per_s', '')} |")


if __name__ == "__main__":
    main()
