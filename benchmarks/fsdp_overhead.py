"""``d9d.shard_params`` against hand-written FSDP2 (``fully_shard``) on the same model and data.

Both variants train the same Llama preset with AdamW on ``--world`` ranks (gloo on CPU, NCCL on
CUDA): d9d with ``shard_params(mesh, "fsdp")`` (eager, and under ``d9d.jit`` with
``--jit``), FSDP2 with ``fully_shard`` on every block and the root plus ``torch.optim.AdamW``.
Reports the median step time after warm-up, their ratio, and peak memory per rank (CUDA: peak
allocated bytes; CPU: peak resident set of the rank's process, which includes the Python
runtime). JSON out:

    python benchmarks/fsdp_overhead.py --preset small --world 2 --out benchmarks/results/fsdp_overhead-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist
from rank_timing import rank_device, time_steps, token_batches

import d9d
from d9d.cli._train import make_train_step
from d9d.models import Llama, LlamaConfig
from d9d.testing import run_on_ranks


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _d9d_rank(preset: str, batches: list[dict], warmup: int, jit: bool) -> dict:
    device = rank_device()
    world = dist.get_world_size()
    mesh = d9d.make_mesh(device.type, fsdp=world)
    model = d9d.functionalize(Llama(LlamaConfig.preset(preset), device=device))
    opt = d9d.optim.adamw(1e-4, weight_decay=0.1)
    step = d9d.shard_params(mesh, "fsdp")(make_train_step(model, opt))
    if jit:
        step = d9d.jit(step)
    params, state = step.place(model.params, opt.init(model.params))
    del model
    holder = {"p": params, "s": state}

    def run(batch):
        local = {k: v.to(device) for k, v in step.shard_batch(batch).items()}
        holder["p"], holder["s"], metrics = step(holder["p"], holder["s"], local)
        return metrics["loss"]

    return {"times": time_steps(run, batches, device, warmup), "peak_bytes": _peak_bytes(device)}


def _fsdp2_rank(preset: str, batches: list[dict], warmup: int, jit: bool) -> dict:
    from torch.distributed.fsdp import fully_shard

    device = rank_device()
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = d9d.make_mesh(device.type, fsdp=world)
    module = Llama(LlamaConfig.preset(preset), device=device)
    for block in module.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)

    def run(batch):
        size = batch["tokens"].shape[0] // world
        tokens = batch["tokens"][rank * size : (rank + 1) * size].to(device)
        labels = batch["labels"][rank * size : (rank + 1) * size].to(device)
        loss = d9d.losses.cross_entropy(module(tokens), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return {"times": time_steps(run, batches, device, warmup), "peak_bytes": _peak_bytes(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--jit", action="store_true", help="also time d9d under d9d.jit")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/fsdp_overhead-cpu.json")
    )
    args = parser.parse_args()
    config = LlamaConfig.preset(args.preset)
    batches = token_batches(
        config.vocab_size, args.batch_size, args.seq_len, args.warmup + args.steps
    )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    variants = {"fsdp2 (fully_shard)": (_fsdp2_rank, False), "d9d shard_params": (_d9d_rank, False)}
    if args.jit:
        variants["d9d shard_params + jit"] = (_d9d_rank, True)
    results = {}
    for name, (fn, jit) in variants.items():
        per_rank = run_on_ranks(
            fn,
            args.world,
            args.preset,
            batches,
            args.warmup,
            jit,
            method="fork",
            backend=backend,
            timeout=3600,
        )
        results[name] = {
            "median_step_ms": round(statistics.median(per_rank[0]["times"]) * 1e3, 3),
            "peak_bytes_per_rank": max(r["peak_bytes"] for r in per_rank),
        }
    base = results["fsdp2 (fully_shard)"]["median_step_ms"]
    for r in results.values():
        r["ratio_to_fsdp2"] = round(r["median_step_ms"] / base, 3)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    device = (
        torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.machine()})"
    )
    report = {
        "benchmark": "fsdp_overhead",
        "device": device,
        "backend": backend,
        "torch": torch.__version__,
        "commit": commit,
        "command": "python benchmarks/fsdp_overhead.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "config": {
            "preset": args.preset,
            "world": args.world,
            "global_batch": args.batch_size,
            "seq_len": args.seq_len,
            "params": config.num_params,
        },
        "peak_memory_note": "CUDA: max_memory_allocated; CPU: peak RSS of the rank process",
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        "| variant | median step (ms) | ratio to FSDP2 | peak memory / rank (MB) |\n|---|---|---|---|"
    )
    for name, r in results.items():
        print(
            f"| {name} | {r['median_step_ms']} | {r['ratio_to_fsdp2']} | {r['peak_bytes_per_rank'] / 2**20:.0f} |"
        )


if __name__ == "__main__":
    main()
