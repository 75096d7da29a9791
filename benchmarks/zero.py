"""Step time, memory and collectives of ``shard_params`` as ZeRO-1, ZeRO-2 and ZeRO-3.

Each variant trains the same Llama preset with AdamW under ``shard_params(mesh, "fsdp",
shard=...)`` on ``--world`` ranks (gloo on CPU, NCCL on CUDA), eager. Variants run
interleaved, ``--rounds`` times each in a rotating order, so that load on a shared machine
falls on all of them alike. Reports per variant the median step time after warm-up over all
rounds, its ratio to ZeRO-3, ``step.memory`` on rank 0 (params, grads, optimizer state) and
``step.comms`` of one step (count and buffer bytes per collective kind). JSON out:

    python benchmarks/zero.py --preset small --world 2 --out benchmarks/results/zero-cpu.json
"""

from __future__ import annotations

import argparse
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

STAGES = {"ZeRO-3": "params", "ZeRO-2": "grads", "ZeRO-1": "opt_state"}


def _rank(preset: str, batches: list[dict], warmup: int, shard: str) -> dict:
    device = rank_device()
    mesh = d9d.make_mesh(device.type, fsdp=dist.get_world_size())
    model = d9d.functionalize(Llama(LlamaConfig.preset(preset), device=device))
    opt = d9d.optim.adamw(1e-4, weight_decay=0.1)
    step = d9d.shard_params(mesh, "fsdp", shard=shard)(make_train_step(model, opt))
    params, state = step.place(model.params, opt.init(model.params))
    del model
    holder = {"p": params, "s": state}

    def local(batch: dict) -> dict:
        return {k: v.to(device) for k, v in step.shard_batch(batch).items()}

    def run(batch: dict) -> torch.Tensor:
        holder["p"], holder["s"], metrics = step(holder["p"], holder["s"], local(batch))
        return metrics["loss"]

    times = time_steps(run, batches, device, warmup)
    memory = step.memory(holder["p"], holder["s"])
    comms = step.comms(holder["p"], holder["s"], local(batches[0]))
    return {
        "times": times,
        "memory": {"params": memory.params, "grads": memory.grads, "opt_state": memory.opt_state},
        "comms": {
            f"{kind} on {axis}": [comms.count[(kind, axis)], b]
            for (kind, axis), b in sorted(comms.bytes.items())
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs per variant")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/zero-cpu.json"))
    args = parser.parse_args()
    config = LlamaConfig.preset(args.preset)
    batches = token_batches(
        config.vocab_size, args.batch_size, args.seq_len, args.warmup + args.steps
    )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    times: dict[str, list[list[float]]] = {name: [] for name in STAGES}
    figures: dict[str, dict] = {}
    names = list(STAGES)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            per_rank = run_on_ranks(
                _rank,
                args.world,
                args.preset,
                batches,
                args.warmup,
                STAGES[name],
                method="fork",
                backend=backend,
                timeout=3600,
            )
            times[name].append(per_rank[0]["times"])
            figures[name] = {k: per_rank[0][k] for k in ("memory", "comms")}
    results = {
        name: {
            "shard": STAGES[name],
            "median_step_ms": round(statistics.median([t for run in runs for t in run]) * 1e3, 3),
            "round_medians_ms": [round(statistics.median(r) * 1e3, 3) for r in runs],
            "memory_bytes_rank0": figures[name]["memory"],
            "collectives_rank0": figures[name]["comms"],
        }
        for name, runs in times.items()
    }
    base = results["ZeRO-3"]["median_step_ms"]
    for r in results.values():
        r["ratio_to_zero3"] = round(r["median_step_ms"] / base, 3)
    report = {
        **provenance("zero", args, device_name(), backend=backend),
        "config": {
            "preset": args.preset,
            "world": args.world,
            "global_batch": args.batch_size,
            "seq_len": args.seq_len,
            "params": config.num_params,
        },
        "collectives_note": "[count, buffer bytes] of one step per kind and mesh axis",
        "results": results,
    }
    write_report(args.out, report)
    print("| stage | median step (ms) | ratio to ZeRO-3 | params + grads + state / rank (MiB) |")
    print("|---|---|---|---|")
    for name, r in results.items():
        total = sum(r["memory_bytes_rank0"].values()) / 2**20
        print(f"| {name} | {r['median_step_ms']} | {r['ratio_to_zero3']} | {total:.1f} |")


if __name__ == "__main__":
    main()
