"""Expert load balance of the ``tiny`` MoE preset over training, with and without the
aux-loss-free bias update (and with and without the Switch aux loss).

Each variant trains ``MoEConfig.tiny()`` (6 experts, top-2, one MoE layer) from the same
init on the same batches with the recipe of ``d9d train --model moe`` (its optimizer, data
and loader: AdamW, lr 3e-3, warmup 20, cosine, clipping 1.0, batch 16 x 128 bytes of the
Python standard library) through ``d9d.models.moe.make_train_step``, and records each step's
``load_balance`` metric: max over mean expert load of the MoE layer (1.0 is perfect). Only
the layer options differ:

  preset            aux loss 0.01, z-loss 1e-3, bias update rate 1e-3 (``MoEConfig.tiny``)
  no bias           the preset with ``bias_update_rate=0``
  bias only         ``aux_loss_coef=0``: balanced by the bias alone
  neither           ``aux_loss_coef=0``, ``bias_update_rate=0``

    python benchmarks/moe_balance.py                      # 4 x 200 steps, about 2 minutes
    python benchmarks/moe_balance.py --steps 50 --out /tmp/balance.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import d9d
from d9d.cli._config import TrainConfig
from d9d.cli._train_step import _optimizer
from d9d.cli.train._data import training_tokens
from d9d.cli.train._run import _loader
from d9d.models import MoE, MoEConfig
from d9d.models.moe import make_train_step

VARIANTS = {
    "preset": {},
    "no bias": {"bias_update_rate": 0.0},
    "bias only": {"aux_loss_coef": 0.0},
    "neither": {"aux_loss_coef": 0.0, "bias_update_rate": 0.0},
}


def train(overrides: dict, steps: int, window: int) -> dict:
    """Trains one variant; returns its per-step balance and loss, and their summaries."""
    config = TrainConfig(model="moe", preset="tiny", steps=steps)
    base = MoEConfig.tiny(seed=config.seed)
    model_config = dataclasses.replace(base, moe=dataclasses.replace(base.moe, **overrides))
    model = d9d.functionalize(MoE(model_config))
    opt = _optimizer(config)
    step = make_train_step(model, opt)
    loader = _loader(config, training_tokens(config.data))
    params, opt_state = model.params, opt.init(model.params)
    balance, loss = [], []
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state, metrics = step(params, opt_state, next(loader))
        balance.append(round(float(metrics["load_balance"]), 4))
        loss.append(round(float(metrics["loss"]), 4))
    bias = {k: v.tolist() for k, v in params.items() if k.endswith("expert_bias")}
    return {
        "moe": {k: getattr(model_config.moe, k) for k in ("aux_loss_coef", "z_loss_coef")}
        | {"bias_update_rate": model_config.moe.bias_update_rate},
        "first_balance_mean": round(statistics.mean(balance[:window]), 4),
        "last_balance_mean": round(statistics.mean(balance[-window:]), 4),
        "max_balance": max(balance),
        "last_loss_mean": round(statistics.mean(loss[-window:]), 4),
        "seconds": round(time.perf_counter() - start, 1),
        "final_expert_bias": {k: [round(b, 4) for b in v] for k, v in bias.items()},
        "balance": balance,
        "loss": loss,
    }


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    argv_used = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=20, help="steps averaged at each end")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv_used)
    torch.manual_seed(0)
    results = {}
    for name, overrides in VARIANTS.items():
        results[name] = train(overrides, args.steps, args.window)
        summary = {k: v for k, v in results[name].items() if k not in ("balance", "loss")}
        print(json.dumps({"variant": name} | summary), flush=True)
    report = {
        "benchmark": "moe_balance",
        "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "commit": _commit(),
        "command": " ".join(["python", "benchmarks/moe_balance.py", *argv_used]),
        "metric": "load_balance: max over mean expert load of the MoE layer per step (1.0 is "
        "perfect); first/last_balance_mean average the first/last --window steps",
        "steps": args.steps,
        "window": args.window,
        "variants": results,
    }
    out = args.out or Path(__file__).parent / "results" / "moe_balance-cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
