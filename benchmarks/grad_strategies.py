"""How should ``d9d.value_and_grad`` differentiate? Measures the candidates on one Llama step.

Candidates: ``torch.autograd.grad`` (what d9d uses) and ``torch.func.grad``, each eager and
under ``torch.compile`` (with Dynamo's ``trace_autograd_ops`` off and on), plus whether each
accepts DTensor params. Reports graphs, graph breaks, compile time and median step time.

    python benchmarks/grad_strategies.py --preset tiny --out benchmarks/results/grad_strategies-cpu.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
import torch._dynamo
import torch._dynamo.config
import torch.distributed as dist
from report import provenance, write_report
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import d9d
from d9d.models import Llama, LlamaConfig


def _autograd_grad(loss_fn):
    return d9d.value_and_grad(loss_fn)


def _func_grad(loss_fn):
    return torch.func.grad_and_value(loss_fn)


def _step(vg_factory, loss_fn):
    vg = vg_factory(loss_fn)

    def step(params, batch):
        out = vg(params, batch)
        grads = out[1] if vg_factory is _autograd_grad else out[0]
        return {k: p - 1e-3 * grads[k] for k, p in params.items()}

    return step


def _time(fn, params, batch, repeats: int) -> tuple[float, float]:
    start = time.perf_counter()
    fn(params, batch)
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(params, batch)
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def _measure(name, fn, params, batch, repeats, *, trace_autograd_ops=False):
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch._dynamo.config.patch(trace_autograd_ops=trace_autograd_ops):
            first, median = _time(fn, params, batch, repeats)
    except Exception as error:  # a candidate that fails is a result, recorded as such
        return {"name": name, "ok": False, "error": f"{type(error).__name__}: {str(error)[:200]}"}
    return {
        "name": name,
        "ok": True,
        "first_call_s": round(first, 3),
        "median_step_ms": round(median * 1e3, 3),
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _dtensor_check(vg_factory, model, batch) -> str:
    mesh = init_device_mesh("cpu", (1,))
    params = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in model.params.items()}

    def loss_fn(p, b):
        p = {k: v.full_tensor() for k, v in p.items()}
        return d9d.losses.cross_entropy(model.apply(p, b["tokens"]), b["labels"])

    try:
        _step(vg_factory, loss_fn)(params, batch)
    except Exception as error:  # recorded, see above
        return f"fails: {type(error).__name__}: {str(error)[:160]}"
    return "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/grad_strategies-cpu.json")
    )
    args = parser.parse_args()
    model = d9d.functionalize(Llama(LlamaConfig.preset(args.preset)))
    tokens = torch.randint(
        0, model.params["embed.weight"].shape[0], (args.batch_size, args.seq_len + 1)
    )
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}

    def loss_fn(p, b):
        return d9d.losses.cross_entropy(model.apply(p, b["tokens"]), b["labels"])

    params = dict(model.params)
    results = []
    for label, factory in (("autograd.grad", _autograd_grad), ("func.grad", _func_grad)):
        step = _step(factory, loss_fn)
        results.append(_measure(f"{label} eager", step, params, batch, args.repeats))
        compiled = torch.compile(step)
        results.append(_measure(f"{label} compile", compiled, params, batch, args.repeats))
        compiled = torch.compile(step)
        results.append(
            _measure(
                f"{label} compile trace_autograd_ops",
                compiled,
                params,
                batch,
                args.repeats,
                trace_autograd_ops=True,
            )
        )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dtensor = {
            "autograd.grad": _dtensor_check(_autograd_grad, model, batch),
            "func.grad": _dtensor_check(_func_grad, model, batch),
        }
    finally:
        dist.destroy_process_group()
    report = {
        **provenance("grad_strategies", args, platform.processor() or platform.machine()),
        "config": {"preset": args.preset, "batch_size": args.batch_size, "seq_len": args.seq_len},
        "results": results,
        "dtensor_params": dtensor,
    }
    write_report(args.out, report)
    for r in results:
        print(r)
    print(dtensor)


if __name__ == "__main__":
    main()
