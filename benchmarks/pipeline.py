"""Pipeline bubbles: the idle fraction of each schedule, measured from stage traces.

Each schedule runs ``d9d.pipeline`` over p forked ranks with m microbatches on a model of 2p
blocks whose compute is a timing model: a block's forward sleeps ``--unit`` seconds, its
input-grad backward one unit and its weight-grad backward one unit (F = 1, B = I + W = 2, the
ratios of the pipeline literature). Sleeping costs no CPU, so p ranks on a 2-core machine
never contend for cores and the trace shows the schedule itself, with the real
``torch.distributed.pipelining`` schedule and real point-to-point transfers. Each rank records
its stage compute spans (``d9d.transforms.pipeline.stage_spans``); its bubble is the part of the
schedule's time they do not cover (the step's gather, reduction and update around the
schedule are not pipeline bubbles). Reported: the mean and largest bubble over ranks (median of the measured
steps), beside the analytic (p - 1) / (m + p - 1) of GPipe and 1F1B and
(p - 1) / (v m + p - 1) of interleaved 1F1B with v stages per rank. JSON out:

    python benchmarks/pipeline.py --out benchmarks/results/pipeline-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch import nn

import d9d
from d9d.errors import RankFailedError
from d9d.testing import run_on_ranks
from d9d.transforms.pipeline import stage_spans

SCHEDULES = {  # name: stages per rank
    "gpipe": 1,
    "1f1b": 1,
    "interleaved_1f1b": 2,
    "interleaved_zb": 2,
    "zbv": 2,
    "dualpipev": 2,
}


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``forward_s`` and backward ``backward_s``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_s)
        return grad, None, None


class _Block(nn.Module):
    """One unit of forward; one unit of input-grad backward; one of weight-grad backward."""

    def __init__(self, dim: int, unit: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.unit = unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.unit, self.unit) + _Sleep.apply(self.weight, 0.0, self.unit)


class _Scale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class _Model(nn.Module):
    """A scale (so the first block's input needs its grad too), then the blocks."""

    def __init__(self, blocks: int, dim: int, unit: float) -> None:
        super().__init__()
        self.scale = _Scale(dim)
        self.layers = nn.ModuleList(_Block(dim, unit) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.scale(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _rank(schedule: str, p: int, m: int, unit: float, steps: int) -> list[float]:
    torch.set_num_threads(1)
    virtual = SCHEDULES[schedule]
    mesh = d9d.make_mesh("cpu", pp=p)
    model = d9d.functionalize(_Model(2 * p, 8, unit))
    opt = d9d.optim.sgd(0.1)

    def loss_fn(params, batch):
        return model.apply(params, batch["x"]).square().mean()

    def step(params, state, batch):
        loss, grads = d9d.value_and_grad(loss_fn)(params, batch)
        updates, state = opt.update(grads, state, params)
        return d9d.optim.apply_updates(params, updates), state, {"loss": loss}

    step = d9d.pipeline(mesh, schedule=schedule, microbatches=m, virtual_stages=virtual)(step)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    batch = {"x": torch.ones(m, 4, 8)}
    bubbles = []
    for i in range(steps + 1):
        torch.distributed.barrier()
        with stage_spans() as spans:
            params, state, _ = step(params, state, batch)
        if i:  # the first step also probes shapes and builds the schedule
            total = sum(end - begin for kind, *_, begin, end in spans if kind == "schedule")
            busy = sum(end - begin for kind, *_, begin, end in spans if kind != "schedule")
            bubbles.append(1 - busy / total)
    return bubbles


def _row(schedule: str, p: int, m: int, unit: float, steps: int) -> dict:
    """The bubbles of ``schedule`` over ``p`` forked ranks and ``m`` microbatches, or the
    ``PlanError`` the schedule refuses them with (DualPipeV: fewer microbatches than stages)."""
    virtual = SCHEDULES[schedule]
    row = {
        "schedule": schedule,
        "p": p,
        "m": m,
        "stages_per_rank": virtual,
        "analytic_1f1b": round((p - 1) / (m + p - 1), 3),
        "analytic_interleaved": round((p - 1) / (virtual * m + p - 1), 3),
    }
    try:
        per_rank = run_on_ranks(_rank, p, schedule, p, m, unit, steps, method="fork", timeout=600)
    except RankFailedError as error:
        if "PlanError" not in str(error):
            raise
        return {**row, "error": str(error).split("PlanError: ")[-1].splitlines()[0]}
    medians = [statistics.median(b) for b in per_rank]
    return {
        **row,
        "bubble_mean": round(statistics.mean(medians), 3),
        "bubble_max": round(max(medians), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--unit", type=float, default=0.01, help="seconds per F, I or W")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline-cpu.json"))
    parser.add_argument(
        "--schedules",
        default=",".join(SCHEDULES),
        help="comma-separated; the other schedules' rows are kept from --out if it exists",
    )
    args = parser.parse_args()
    chosen = args.schedules.split(",")
    unknown = sorted(set(chosen) - set(SCHEDULES))
    if unknown:
        parser.error(f"--schedules names unknown {unknown}: schedules are {list(SCHEDULES)}")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    rows = []
    if args.out.exists() and set(chosen) != set(SCHEDULES):
        old = json.loads(args.out.read_text())
        kept = (row for row in old["results"] if row["schedule"] not in chosen)
        rows = [{**row, "commit": row.get("commit", old["commit"])} for row in kept]
    for p in (2, 4):
        for m in (4, 8, 16):
            for schedule in chosen:
                rows.append({**_row(schedule, p, m, args.unit, args.steps), "commit": commit})
                print(rows[-1], flush=True)
    order = list(SCHEDULES)
    rows.sort(key=lambda row: (row["p"], row["m"], order.index(row["schedule"])))
    report = {
        "command": "python benchmarks/pipeline.py",
        "commit": commit,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": torch.get_num_threads(),
        "torch": torch.__version__,
        "unit_s": args.unit,
        "blocks": "2 per pipeline rank",
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
