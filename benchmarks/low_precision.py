"""bfloat16 params: stochastic rounding against round-to-nearest and float32 master weights.

``d9d train``'s tiny Llama (2 blocks, 125 K params, byte-level) on its default data (the
Python standard library's source), with its default recipe (AdamW, b2 0.95, lr 3e-3 with a
20-step warmup and a cosine to 3e-4, weight decay 0.1 on matrices, clipping at 1.0, 16 x 128
tokens a step). Every variant computes the forward and backward in bfloat16 from the same
initial weights and batches; they differ only in what holds the weights between steps:

  float32 master             float32 params (cast to bfloat16 for the forward), float32 moments
  float32 master, bf16 moments   the same, ``adamw(mu_dtype=bf16, nu_dtype=bf16)``
  bfloat16, round to nearest     bfloat16 params; ``p.float() + update`` rounded to nearest
  bfloat16, stochastic rounding  the same, rounded by ``d9d.optim.stochastic_round``

Both bfloat16 variants keep float32 moments, so only the rounding of the weights differs.
The figure is the mean training loss of the last 20 steps; stochastic rounding runs once per
seed of its random bits (``--seeds``), since one seed's final loss is one draw.

    python benchmarks/low_precision.py --steps 200 --seeds 3 \
        --out benchmarks/results/low-precision-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

import d9d
from d9d import data, losses, optim
from d9d.models import Llama, LlamaConfig

VARIANTS = (
    "float32 master",
    "float32 master, bf16 moments",
    "bfloat16, round to nearest",
    "bfloat16, stochastic rounding",
)


def _optimizer(variant: str, steps: int, lr: float, seed: int) -> optim.GradientTransformation:
    moments = torch.bfloat16 if variant == "float32 master, bf16 moments" else torch.float32
    adamw = optim.adamw(
        optim.warmup_cosine(lr, min(20, steps - 1), max(steps, 2), end_value=lr / 10),
        b2=0.95,
        weight_decay=0.1,
        mask=lambda path, p: p.ndim >= 2,
        mu_dtype=moments,
        nu_dtype=moments,
    )
    if variant == "bfloat16, stochastic rounding":
        adamw = optim.stochastic_round(adamw, seed=seed)
    return optim.chain(optim.clip_by_global_norm(1.0), adamw)


def train(
    variant: str,
    *,
    steps: int,
    batch_size: int = 16,
    seq_len: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """The per-step training losses of ``variant`` (one of ``VARIANTS``); ``seed`` keys the
    stochastic rounding (the weights and batches are the same for every seed)."""
    torch.manual_seed(0)
    model = d9d.functionalize(Llama(LlamaConfig.tiny()))
    params = model.params
    if variant.startswith("bfloat16"):
        params = {path: p.to(torch.bfloat16) for path, p in params.items()}
    opt = _optimizer(variant, steps, lr, seed)
    state = opt.init(params)
    loader = data.TokenLoader(
        data.stdlib_corpus(), global_batch_size=batch_size, seq_len=seq_len, seed=0
    )

    def loss_fn(params: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        computed = {path: p.to(torch.bfloat16) for path, p in params.items()}
        logits = model.apply(computed, batch["tokens"])
        return losses.cross_entropy(logits.float(), batch["labels"])

    out = []
    for _ in range(steps):
        loss, grads = d9d.value_and_grad(loss_fn)(params, next(loader))
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        out.append(loss.item())
    return out


def final_loss(losses_: list[float], last: int = 20) -> float:
    """The mean of the last ``last`` losses."""
    tail = losses_[-last:]
    return sum(tail) / len(tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("low-precision-cpu.json"))
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core "
        "machine one thread ran a tiny step 0.08 s, two threads 0.5-1.2 s)",
    )
    parser.add_argument(
        "--seeds", type=int, default=3, help="stochastic-rounding seeds to run (default 3)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    runs = [(variant, 0) for variant in VARIANTS]
    runs += [(VARIANTS[-1], seed) for seed in range(1, args.seeds)]
    for variant, seed in runs:
        start = time.perf_counter()
        curve = train(variant, steps=args.steps, seed=seed)
        rows.append(
            {
                "variant": variant,
                "seed": seed,
                "final_loss": round(final_loss(curve), 4),
                "seconds": round(time.perf_counter() - start, 1),
                "losses": [round(x, 4) for x in curve],
            }
        )
        print(f"{variant} ({seed=}): final loss {rows[-1]['final_loss']} ({rows[-1]['seconds']} s)")
    master = rows[0]["final_loss"]
    for row in rows:
        row["vs_float32_master"] = round(row["final_loss"] / master - 1, 4)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    report = {
        "command": f"python benchmarks/low_precision.py --steps {args.steps} "
        f"--threads {args.threads} --seeds {args.seeds}",
        "device": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "commit": commit,
        "steps": args.steps,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
