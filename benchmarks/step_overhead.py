"""d9d's step against the hand-written PyTorch loop on the same model: eager and jit.

Variants, each training the same Llama preset with AdamW + global-norm clipping:
  torch       ``loss.backward()``, ``clip_grad_norm_``, ``torch.optim.AdamW(foreach=True)``
  d9d eager   ``d9d.value_and_grad`` + ``d9d.optim`` (``_foreach`` updates)
  d9d eager, no embedding check
              the same, without the eager check of the token ids against the vocab
              (``d9d.core._embedding_ids``: one ``aminmax`` and one read back to the host per step)
  d9d jit     the same step under ``d9d.jit`` (one compiled graph, params donated)
  d9d jit, no index guard
              the same, compiled without ``d9d::check_index`` on the token ids and labels
              (what ``d9d.jit`` did before it raised on out-of-range ids): its cost per step
Reports the median step time over repeats (warm-up and compilation excluded), tokens/s and
the ratio to ``torch``, and the median time of each per-call input check on its own. JSON out:

    python benchmarks/step_overhead.py --preset small --out benchmarks/results/step_overhead-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

import d9d
import d9d.core._jit
import d9d.core._model
from d9d.cli._train_step import make_train_step
from d9d.core._batch_check import batch_signature
from d9d.core._index_checks import check_index, raise_outside
from d9d.models import Llama, LlamaConfig


def _batches(vocab: int, batch_size: int, seq_len: int, count: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g).to(device)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _torch_loop(config: LlamaConfig, lr: float, device: torch.device):
    module = Llama(config, device=device)
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.1, foreach=True)

    def run(batch):
        opt.zero_grad(set_to_none=True)
        logits = module(batch["tokens"])
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch["labels"].flatten()
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0, foreach=True)
        opt.step()
        return loss

    return run


def _d9d_loop(config: LlamaConfig, lr: float, device: torch.device, *, jit: bool):
    model = d9d.functionalize(Llama(config, device=device))
    opt = d9d.optim.chain(d9d.optim.clip_by_global_norm(1.0), d9d.optim.adamw(lr, weight_decay=0.1))
    step = make_train_step(model, opt)
    if jit:
        step = d9d.jit(step)
    state = {"params": d9d.tree.map(torch.clone, model.params)}
    state["opt"] = opt.init(state["params"])

    def run(batch):
        state["params"], state["opt"], metrics = step(state["params"], state["opt"], batch)
        return metrics["loss"]

    return run


def _without_index_guard(run: Callable) -> Callable:
    """``run`` whose first call (the compile) leaves the ids unguarded."""
    compiled = False

    def call(batch):
        nonlocal compiled
        if compiled:
            return run(batch)
        with mock.patch.object(d9d.core._jit, "guard_indices", lambda graph: 0):
            out = run(batch)
        compiled = True
        return out

    return call


def _without_embedding_check(run: Callable) -> Callable:
    """``run`` with ``Model.apply``'s eager check of the embeddings' ids switched off."""

    def call(batch):
        with mock.patch.object(d9d.core._model, "embedding_checks", lambda modules: nullcontext()):
            return run(batch)

    return call


def _check_costs_us(config: LlamaConfig, batch: dict, device: torch.device) -> dict[str, float]:
    """Median microseconds of each check a step runs on every call, on its own."""
    model = d9d.functionalize(Llama(config, device=device))
    checks = {
        "check_index (token ids)": lambda: check_index(batch["tokens"], config.vocab_size, ""),
        "raise_outside (eager token ids)": lambda: raise_outside(
            batch["tokens"], config.vocab_size, ""
        ),
        "Model.check_params": lambda: model.check_params(model.params),
        "batch_signature": lambda: batch_signature(batch),
    }
    out = {}
    for name, fn in checks.items():
        times = []
        for _ in range(200):
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - start)
        out[name] = round(statistics.median(times[20:]) * 1e6, 1)
    return out


def _time_steps(run, batches, device: torch.device, *, warmup: int, steps: int) -> list[float]:
    for batch in batches[:warmup]:
        run(batch)
    _sync(device)
    times = []
    for batch in batches[warmup : warmup + steps]:
        start = time.perf_counter()
        run(batch)
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/step_overhead-cpu.json")
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = LlamaConfig.preset(args.preset)
    batches = _batches(
        config.vocab_size, args.batch_size, args.seq_len, args.warmup + args.steps, device
    )
    builders = {
        "torch": lambda: _torch_loop(config, 1e-3, device),
        "d9d eager": lambda: _d9d_loop(config, 1e-3, device, jit=False),
        "d9d eager, no embedding check": lambda: _without_embedding_check(
            _d9d_loop(config, 1e-3, device, jit=False)
        ),
        "d9d jit": lambda: _d9d_loop(config, 1e-3, device, jit=True),
        "d9d jit, no index guard": lambda: _without_index_guard(
            _d9d_loop(config, 1e-3, device, jit=True)
        ),
    }
    medians: dict[str, list[float]] = {name: [] for name in builders}
    for _ in range(args.repeats):
        for name, build in builders.items():
            times = _time_steps(build(), batches, device, warmup=args.warmup, steps=args.steps)
            medians[name].append(statistics.median(times))
    tokens = args.batch_size * args.seq_len
    base = statistics.median(medians["torch"])
    results = []
    for name, values in medians.items():
        median = statistics.median(values)
        results.append(
            {
                "variant": name,
                "median_step_ms": round(median * 1e3, 3),
                "min_step_ms": round(min(values) * 1e3, 3),
                "max_step_ms": round(max(values) * 1e3, 3),
                "tokens_per_s": round(tokens / median),
                "ratio_to_torch": round(median / base, 3),
            }
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    device_name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    )
    report = {
        "benchmark": "step_overhead",
        "device": device_name,
        "torch": torch.__version__,
        "commit": commit,
        "command": "python benchmarks/step_overhead.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "config": {
            "preset": args.preset,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "params": sum(p.numel() for p in Llama(config, device="meta").parameters()),
        },
        "results": results,
        "checks_us": _check_costs_us(config, batches[0], device),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("| variant | median step (ms) | tokens/s | ratio to torch |\n|---|---|---|---|")
    for r in results:
        print(
            f"| {r['variant']} | {r['median_step_ms']} | {r['tokens_per_s']} | {r['ratio_to_torch']} |"
        )
    for name, us in report["checks_us"].items():
        print(f"{name}: {us} us")


if __name__ == "__main__":
    main()
