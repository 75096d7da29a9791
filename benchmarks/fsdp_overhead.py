"""``d9d.shard_params`` against hand-written FSDP2 (``fully_shard``) on the same model and data.

Every variant trains the same Llama preset with AdamW on ``--world`` ranks (gloo on CPU, NCCL
on CUDA): d9d with ``shard_params(mesh, "fsdp")`` with and without ``prefetch`` (eager, and
under ``d9d.jit`` with ``--jit``); FSDP2 with ``fully_shard`` on every block and the root plus
``torch.optim.AdamW``, as it comes (its backward prefetches one block; its forward issues each
block's all-gather when the block starts, which overlaps only where the device runs behind
the host) and with explicit prefetch of the next block forward and the previous one backward
(``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``, as torchtitan
sets them). Variants run interleaved, ``--rounds`` times each in a rotating order, so that
load on a shared machine falls on all of them alike.

Reports the median step time after warm-up over all rounds, its ratio to FSDP2, the ratio of
d9d without prefetch to d9d with it in each round, and peak memory per rank (CUDA: peak
allocated bytes; CPU: peak resident set of the rank's process, which includes the Python
runtime). JSON out:

    python benchmarks/fsdp_overhead.py --preset small --world 2 --out benchmarks/results/fsdp_overhead-cpu.json
"""

from __future__ import annotations

import argparse
import itertools
import resource
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from rank_timing import rank_device, time_steps, token_batches
from report import device_name, provenance, write_report

import d9d
from d9d.cli._train_step import make_train_step
from d9d.models import Llama, LlamaConfig
from d9d.testing import run_on_ranks


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _d9d_rank(preset: str, batches: list[dict], warmup: int, jit: bool, prefetch: bool) -> dict:
    device = rank_device()
    world = dist.get_world_size()
    mesh = d9d.make_mesh(device.type, fsdp=world)
    model = d9d.functionalize(Llama(LlamaConfig.preset(preset), device=device))
    opt = d9d.optim.adamw(1e-4, weight_decay=0.1)
    step = d9d.shard_params(mesh, "fsdp", prefetch=prefetch)(make_train_step(model, opt))
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


def _fsdp2_rank(preset: str, batches: list[dict], warmup: int, jit: bool, prefetch: bool) -> dict:
    from torch.distributed.fsdp import fully_shard

    del jit
    device = rank_device()
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = d9d.make_mesh(device.type, fsdp=world)
    module = Llama(LlamaConfig.preset(preset), device=device)
    blocks = list(module.layers)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    if prefetch:
        for before, after in itertools.pairwise(blocks):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
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
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs per variant")
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
    # name: (rank function, jit, prefetch)
    variants = {
        "fsdp2 (fully_shard)": (_fsdp2_rank, False, False),
        "fsdp2 + explicit prefetch": (_fsdp2_rank, False, True),
        "d9d shard_params, no prefetch": (_d9d_rank, False, False),
        "d9d shard_params (prefetch)": (_d9d_rank, False, True),
    }
    if args.jit:
        variants["d9d shard_params + jit"] = (_d9d_rank, True, True)
    times: dict[str, list[list[float]]] = {name: [] for name in variants}
    peaks: dict[str, int] = dict.fromkeys(variants, 0)
    names = list(variants)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            fn, jit, prefetch = variants[name]
            per_rank = run_on_ranks(
                fn,
                args.world,
                args.preset,
                batches,
                args.warmup,
                jit,
                prefetch,
                method="fork",
                backend=backend,
                timeout=3600,
            )
            times[name].append(per_rank[0]["times"])
            peaks[name] = max(peaks[name], *(r["peak_bytes"] for r in per_rank))
    results = {
        name: {
            "median_step_ms": round(statistics.median([t for run in runs for t in run]) * 1e3, 3),
            "round_medians_ms": [round(statistics.median(r) * 1e3, 3) for r in runs],
            "peak_bytes_per_rank": peaks[name],
        }
        for name, runs in times.items()
    }
    base = results["fsdp2 (fully_shard)"]["median_step_ms"]
    for r in results.values():
        r["ratio_to_fsdp2"] = round(r["median_step_ms"] / base, 3)
    without = results["d9d shard_params, no prefetch"]["round_medians_ms"]
    with_ = results["d9d shard_params (prefetch)"]["round_medians_ms"]
    speedups = [round(a / b, 3) for a, b in zip(without, with_, strict=True)]
    fsdp2 = results["fsdp2 (fully_shard)"]["round_medians_ms"]
    fsdp2_prefetch = results["fsdp2 + explicit prefetch"]["round_medians_ms"]
    fsdp2_speedups = [round(a / b, 3) for a, b in zip(fsdp2, fsdp2_prefetch, strict=True)]
    report = {
        **provenance("fsdp_overhead", args, device_name(), backend=backend),
        "config": {
            "preset": args.preset,
            "world": args.world,
            "global_batch": args.batch_size,
            "seq_len": args.seq_len,
            "params": config.num_params,
        },
        "peak_memory_note": "CUDA: max_memory_allocated; CPU: peak RSS of the rank process",
        "prefetch_speedup_per_round": {
            "d9d (no prefetch / prefetch)": speedups,
            "fsdp2 (as it comes / explicit prefetch)": fsdp2_speedups,
        },
        "results": results,
    }
    write_report(args.out, report)
    print(
        "| variant | median step (ms) | ratio to FSDP2 | peak memory / rank (MiB) |\n|---|---|---|---|"
    )
    for name, r in results.items():
        print(
            f"| {name} | {r['median_step_ms']} | {r['ratio_to_fsdp2']} | {r['peak_bytes_per_rank'] / 2**20:.0f} |"
        )
    print(f"d9d no prefetch / prefetch, per round: {speedups}")
    print(f"fsdp2 as it comes / explicit prefetch, per round: {fsdp2_speedups}")


if __name__ == "__main__":
    main()
