"""Tensor and context parallelism against one device and against PyTorch's own TP plan.

Variants, each training the same Llama preset with AdamW on the same global batches:
  one device              the plain d9d step in one process, whole batches
  d9d tp=N                ``tensor_parallel`` (sequence and loss parallel)
  d9d tp=N, no SP         ``tensor_parallel(sequence_parallel=False, loss_parallel=False)``
  parallelize_module      ``torch.distributed.tensor.parallel`` Colwise/Rowwise plan on the
                          same module (no sequence parallelism) + ``torch.optim.AdamW``
  d9d cp=N                ``context_parallel`` (zigzag ring attention)
Ranks are forked processes (gloo on CPU, NCCL on CUDA). Reports the median step time after
warm-up, tokens/s of the global batch, and the bytes autograd saves for the backward in one
forward on rank 0 (activations, params excluded): the activation memory that TP with sequence
parallelism and CP divide. JSON out:

    python benchmarks/tp_cp.py --preset small --world 2 --out benchmarks/results/tp_cp-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from rank_timing import rank_device, time_steps, token_batches
from report import device_name, provenance, significant, write_report

import d9d
from d9d.cli._train_step import make_train_step
from d9d.models import Llama, LlamaConfig
from d9d.testing import run_on_ranks


@contextmanager
def _saved_bytes(skip: set[int], total: list[int]):
    """Sum the bytes of distinct storages autograd saves for the backward (not in ``skip``)."""
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t
        try:
            ptr, size = local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()
        except RuntimeError:  # a wrapper subclass without storage: count its elements
            ptr, size = id(local), local.numel() * local.element_size()
        if ptr not in skip and ptr not in seen:
            seen.add(ptr)
            total[0] += size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _storages(tensors) -> set[int]:
    out = set()
    for t in tensors:
        local = t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t
        out.add(local.untyped_storage().data_ptr())
    return out


def _d9d_rank(preset: str, batches: list[dict], warmup: int, variant: str) -> dict:
    device = rank_device()
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = d9d.functionalize(Llama(LlamaConfig.preset(preset), device=device))
    opt = d9d.optim.adamw(1e-4, weight_decay=0.1)
    step = make_train_step(model, opt)
    if variant == "one device":
        params, state = dict(model.params), opt.init(model.params)
    else:
        axis = "cp" if variant.startswith("d9d cp") else "tp"
        mesh = d9d.make_mesh(device.type, **{axis: world})
        if axis == "cp":
            transform = d9d.context_parallel(mesh)
        elif "no SP" in variant:
            transform = d9d.tensor_parallel(mesh, sequence_parallel=False, loss_parallel=False)
        else:
            transform = d9d.tensor_parallel(mesh)
        step = transform(step)
        params, state = step.place(model.params, opt.init(model.params), axes=model.axes)
    holder = {"p": params, "s": state}

    def run(batch):
        local = {k: v.to(device) for k, v in batch.items()}
        holder["p"], holder["s"], _ = step(holder["p"], holder["s"], local)

    times = time_steps(run, batches, device, warmup)
    saved = [0]

    def forward_only(params, batch):
        return d9d.losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])

    loss_fn = d9d.value_and_grad(forward_only)
    skip = _storages(holder["p"].values())
    batch = {k: v.to(device) for k, v in batches[0].items()}
    if variant == "one device":
        with _saved_bytes(skip, saved):
            loss_fn(holder["p"], batch)
    else:
        from d9d.core._context import running

        for runtime in step.runtimes:
            batch = runtime.on_batch(batch)
        with running(step.context()), _saved_bytes(skip, saved):
            loss_fn(holder["p"], batch)
    return {"times": times, "saved_bytes": saved[0]}


def _torch_tp_rank(preset: str, batches: list[dict], warmup: int, variant: str) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    device = rank_device()
    mesh = d9d.make_mesh(device.type, tp=dist.get_world_size())
    module = Llama(LlamaConfig.preset(preset), device=device)
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(module.layers)):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w_gate", "mlp.w_up"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.w_down"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(module, mesh, plan)
    # Norm weights stay plain tensors; foreach updates cannot mix them with DTensors.
    groups = {}
    for p in module.parameters():
        groups.setdefault(isinstance(p, torch.distributed.tensor.DTensor), []).append(p)
    opts = [
        torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=True) for ps in groups.values()
    ]

    def loss_of(batch):
        return d9d.losses.cross_entropy(module(batch["tokens"]), batch["labels"])

    def run(batch):
        loss = loss_of({k: v.to(device) for k, v in batch.items()})
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    times = time_steps(run, batches, device, warmup)
    saved = [0]
    with _saved_bytes(_storages(module.parameters()), saved):
        loss_of({k: v.to(device) for k, v in batches[0].items()})
    return {"times": times, "saved_bytes": saved[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tp_cp-cpu.json"))
    args = parser.parse_args()
    config = LlamaConfig.preset(args.preset)
    batches = token_batches(
        config.vocab_size, args.batch_size, args.seq_len, args.warmup + args.steps
    )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    n = args.world
    variants = {
        "one device": (_d9d_rank, 1),
        f"d9d tp={n}": (_d9d_rank, n),
        f"d9d tp={n}, no SP": (_d9d_rank, n),
        f"parallelize_module tp={n}": (_torch_tp_rank, n),
        f"d9d cp={n}": (_d9d_rank, n),
    }
    results = {}
    tokens = args.batch_size * args.seq_len
    for name, (fn, world) in variants.items():
        if world == 1:
            per_rank = [fn(args.preset, batches, args.warmup, name)]
        else:
            per_rank = run_on_ranks(
                fn, world, args.preset, batches, args.warmup, name,
                method="fork", backend=backend, timeout=3600,
            )  # fmt: skip
        step_s = statistics.median(per_rank[0]["times"])
        results[name] = {
            "median_step_ms": round(step_s * 1e3, 3),
            "tokens_per_s": round(tokens / step_s),
            "saved_activation_bytes_rank0": per_rank[0]["saved_bytes"],
        }
    base = results["one device"]
    for r in results.values():
        r["speedup_vs_one_device"] = significant(base["median_step_ms"] / r["median_step_ms"])
        r["activation_fraction"] = round(
            r["saved_activation_bytes_rank0"] / base["saved_activation_bytes_rank0"], 3
        )
    report = {
        **provenance("tp_cp", args, device_name(), backend=backend),
        "config": {
            "preset": args.preset,
            "world": args.world,
            "global_batch": args.batch_size,
            "seq_len": args.seq_len,
            "params": config.num_params,
        },
        "results": results,
    }
    write_report(args.out, report)
    print(
        "| variant | median step (ms) | tokens/s | vs one device | saved activations rank 0 (MiB) | fraction |\n"
        "|---|---|---|---|---|---|"
    )
    for name, r in results.items():
        print(
            f"| {name} | {r['median_step_ms']} | {r['tokens_per_s']} | "
            f"{r['speedup_vs_one_device']}x | {r['saved_activation_bytes_rank0'] / 2**20:.1f} | "
            f"{r['activation_fraction']} |"
        )


if __name__ == "__main__":
    main()
