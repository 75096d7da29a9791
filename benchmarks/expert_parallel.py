"""Expert parallelism against experts replicated: step time, all-to-all bytes, routing sync.

Variants, each training the same MoE preset with AdamW on the same global batches, on
``--world`` forked ranks (gloo on CPU, NCCL on CUDA):
  replicated    ``shard_params(replicate_axis="dp")``: every rank holds every expert (DDP)
  ep=N          ``expert_parallel``: each rank holds E / N experts; rows dispatched to them
                and combined back by all-to-all
Reports the median step time after warm-up, tokens/s of the global batch, the expert and
all param bytes rank 0 stores, one step's all-to-all bytes (``step.comms``), and the wall
time per step of the routes (the all-to-all of the dispatch counts and the host read of the
split sizes, one per MoE layer in the forward; it includes waiting for the slowest ep rank).
JSON out:

    python benchmarks/expert_parallel.py --preset small --world 2 \\
        --out benchmarks/results/expert_parallel-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rank_timing import rank_device, time_steps, token_batches
from report import device_name, provenance, significant, write_report

import d9d
from d9d.kernels import _moe_dispatch_c10d as c10d_dispatch
from d9d.models import MoE, MoEConfig
from d9d.models.moe import make_train_step
from d9d.testing import run_on_ranks


def _rank(preset: str, batches: list[dict], warmup: int, variant: str) -> dict:
    device = rank_device()
    world = dist.get_world_size()
    model = d9d.functionalize(MoE(MoEConfig.preset(preset), device=device))
    opt = d9d.optim.adamw(1e-4, weight_decay=0.1)
    step = make_train_step(model, opt)
    if variant == "replicated":
        mesh = d9d.make_mesh(device.type, dp=world)
        step = d9d.shard_params(mesh, None, replicate_axis="dp")(step)
    else:
        mesh = d9d.make_mesh(device.type, ep=world)
        step = d9d.expert_parallel(mesh)(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    holder = {"p": params, "s": state}
    route_s = [0.0]
    split_sizes = c10d_dispatch.split_sizes

    def timed_route(*args):  # the counts' all-to-all and the host read of the split sizes
        start = time.perf_counter()
        out = split_sizes(*args)
        route_s[0] += time.perf_counter() - start
        return out

    c10d_dispatch.split_sizes = timed_route

    def run(batch):
        local = {k: v.to(device) for k, v in step.shard_batch(batch).items()}
        holder["p"], holder["s"], _ = step(holder["p"], holder["s"], local)

    try:
        times = time_steps(run, batches, device, warmup)
        route_s[0] = 0.0
        time_steps(run, batches[:1], device, 0)  # one step's route time alone
        comms = step.comms(holder["p"], holder["s"], step.shard_batch(batches[0]))
    finally:
        c10d_dispatch.split_sizes = split_sizes
    local = {k: v.to_local() for k, v in holder["p"].items()}
    expert_bytes = sum(v.numel() * v.element_size() for k, v in local.items() if ".experts." in k)
    return {
        "times": times,
        "route_s": route_s[0],
        "all_to_all_bytes": comms.total_bytes("all_to_all"),
        "expert_param_bytes": expert_bytes,
        "param_bytes": sum(v.numel() * v.element_size() for v in local.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/expert_parallel-cpu.json")
    )
    args = parser.parse_args()
    config = MoEConfig.preset(args.preset)
    batches = token_batches(
        config.vocab_size, args.batch_size, args.seq_len, args.warmup + args.steps
    )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    tokens = args.batch_size * args.seq_len
    results = {}
    for name in ("replicated", f"ep={args.world}"):
        per_rank = run_on_ranks(
            _rank, args.world, args.preset, batches, args.warmup, name,
            method="fork", backend=backend, timeout=3600,
        )  # fmt: skip
        step_s = statistics.median(per_rank[0]["times"])
        results[name] = {
            "median_step_ms": round(step_s * 1e3, 3),
            "tokens_per_s": round(tokens / step_s),
            "route_ms_per_step": round(per_rank[0]["route_s"] * 1e3, 3),
            "all_to_all_bytes_rank0": per_rank[0]["all_to_all_bytes"],
            "expert_param_bytes_rank0": per_rank[0]["expert_param_bytes"],
            "param_bytes_rank0": per_rank[0]["param_bytes"],
        }
    base = results["replicated"]
    for r in results.values():
        r["speedup_vs_replicated"] = significant(base["median_step_ms"] / r["median_step_ms"])
    report = {
        **provenance("expert_parallel", args, device_name(), backend=backend),
        "config": {
            "preset": args.preset,
            "world": args.world,
            "global_batch": args.batch_size,
            "seq_len": args.seq_len,
            "experts": config.moe.n_experts,
            "top_k": config.moe.top_k,
            "params": sum(v.numel() for v in MoE(config, device="meta").parameters()),
        },
        "results": results,
    }
    write_report(args.out, report)
    print(
        "| variant | median step (ms) | tokens/s | vs replicated | route (ms/step) | "
        "all-to-all (MB/step) | params rank 0 (MB) |\n|---|---|---|---|---|---|---|"
    )
    for name, r in results.items():
        print(
            f"| {name} | {r['median_step_ms']} | {r['tokens_per_s']} | "
            f"{r['speedup_vs_replicated']}x | {r['route_ms_per_step']} | "
            f"{r['all_to_all_bytes_rank0'] / 1e6:.2f} | {r['param_bytes_rank0'] / 1e6:.2f} |"
        )


if __name__ == "__main__":
    main()
