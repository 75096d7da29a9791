"""Bytes a forward keeps for the backward per block, under no remat and ``d9d.remat``'s
``"selective"`` and ``"full"`` policies, on one CPU process (float32).

Per block is the difference between the model with ``2L`` and ``L`` blocks, divided by ``L``:
what each added block keeps (op outputs still alive after the forward, params excluded,
measured with ``d9d.testing.KeptBytes``). JSON out:

    python benchmarks/remat.py --preset small --out benchmarks/results/remat-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

import torch

import d9d
from d9d.core._context import running
from d9d.models import Llama, LlamaConfig
from d9d.testing import KeptBytes, run_on_ranks


def kept(preset: str, policy: str | None, n_layers: int, batch: int, seq: int) -> int:
    def rank() -> int:
        mesh = d9d.make_mesh("cpu", dp=1)
        torch.manual_seed(0)
        model = d9d.functionalize(Llama(LlamaConfig.preset(preset, n_layers=n_layers)))
        transform = (
            d9d.remat(policy, mesh=mesh)
            if policy
            else d9d.shard_params(mesh, axis=None, replicate_axis="dp")
        )
        step = transform(lambda p, s, b: (p, s, {}))
        params, _ = step.place(model.params, ())
        params = {p: v.detach().requires_grad_(True) for p, v in params.items()}
        skip = {v.to_local().untyped_storage().data_ptr() for v in params.values()}
        tokens = torch.randint(0, model.module.config.vocab_size, (batch, seq))
        with running(step.context()):
            with KeptBytes() as seen:
                loss = model.apply(params, tokens).float().mean()
            out = seen.alive(skip)
            del loss
        return out

    return run_on_ranks(rank, 1, timeout=600)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--layers", type=int, default=2, help="L: compare 2L blocks with L")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    config = LlamaConfig.preset(args.preset)
    block_input = args.batch_size * args.seq_len * config.dim * 4
    results = []
    for name, policy in (("none", None), ("selective", "selective"), ("full", "full")):
        small = kept(args.preset, policy, args.layers, args.batch_size, args.seq_len)
        large = kept(args.preset, policy, 2 * args.layers, args.batch_size, args.seq_len)
        per_block = (large - small) // args.layers
        results.append(
            {
                "policy": name,
                "kept_bytes_per_block": per_block,
                "block_inputs": round(per_block / block_input, 2),
            }
        )
        print(f"{name:>10}: {per_block:>12,} B per block ({per_block / block_input:.2f} x input)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    report = {
        "benchmark": "remat",
        "device": f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "commit": commit.stdout.strip(),
        "command": "python benchmarks/remat.py "
        + f"--preset {args.preset} --layers {args.layers} --batch-size {args.batch_size} "
        + f"--seq-len {args.seq_len}",
        "config": {"preset": args.preset, "dim": config.dim, "block_input_bytes": block_input},
        "results": results,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
