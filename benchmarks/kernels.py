"""Kernel benchmark: each ``d9d.kernels`` op on Llama-3 8B shapes, Triton vs eager PyTorch,
``torch.compile`` of the reference and Liger-Kernel (when installed).

Reports the median time of ``--reps`` runs after ``--warmup``, achieved GB/s from explicit
byte counts (the bytes an ideal kernel must move: each input read once, each output written
once) as a share of the measured device-to-device copy bandwidth, TFLOP/s for the fused
linear cross-entropy, and peak memory for the cross-entropy ops; checks the issue's
targets; writes JSON to ``benchmarks/results/kernels-<device>.json``.

    python benchmarks/kernels.py                      # needs a CUDA device
    python benchmarks/kernels.py --only rms_norm,swiglu --no-compile
    python benchmarks/kernels.py --cpu-smoke --out /tmp/kernels.json   # tiny, Triton interpreter
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# Llama-3 8B: hidden 4096, MLP 14336, vocab 128256, 32 query and 8 key/value heads of 128,
# one batch of 8192 tokens. The smoke sizes only exercise the code path.
LLAMA3_8B = {"tokens": 8192, "hidden": 4096, "mlp": 14336, "vocab": 128256, "heads": (32, 8, 128)}
SMOKE = {"tokens": 24, "hidden": 40, "mlp": 56, "vocab": 300, "heads": (4, 2, 16)}


@dataclass(frozen=True)
class Case:
    """One op at one shape: how to make inputs, run each implementation, and count work."""

    op: str
    shape: str  # the model shape it stands for, e.g. "8192x4096"
    make: Callable[[], dict]  # -> keyword inputs
    impls: dict[str, Callable[..., object]]  # name -> fn(**inputs) -> output tensor(s)
    bytes_fwd: int
    bytes_fwd_bwd: int | None  # None: no backward (adamw)
    flops_fwd: int = 0
    flops_fwd_bwd: int = 0
    memory: bool = False  # record peak memory of forward + backward


def _liger():
    """Liger-Kernel's ``transformers`` module if installed, else None."""
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        return None
    return liger


class _Maker:
    """Random inputs of one dtype on one device."""

    def __init__(self, dtype: torch.dtype, device: str) -> None:
        self.dtype, self.device = dtype, device
        self.size = torch.tensor([], dtype=dtype).element_size()

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        x = scale * torch.randn(*shape, device=self.device)
        return x.to(self.dtype).requires_grad_()

    def labels(self, n: int, vocab: int) -> torch.Tensor:
        return torch.randint(0, vocab, (n,), device=self.device)


def _triton(fn: Callable[..., object]) -> Callable[..., object]:
    return lambda **kw: fn(**kw, backend="triton")


def _norm_and_mlp_cases(sizes: dict, m: _Maker, liger) -> list[Case]:
    import d9d.kernels as K
    from d9d.kernels import _reference as R

    cases = []
    for rows, cols in ((sizes["tokens"], sizes["hidden"]), (sizes["tokens"], sizes["mlp"])):
        nbytes = rows * cols * m.size

        def norm_inputs(rows=rows, cols=cols):
            return {"x": m.randn(rows, cols), "weight": m.randn(cols), "eps": 1e-6}

        def mlp_inputs(rows=rows, cols=cols):
            return {"gate": m.randn(rows, cols), "up": m.randn(rows, cols)}

        norm = {"triton": _triton(K.rms_norm), "eager": R.rms_norm}
        mlp = {"triton": _triton(K.swiglu), "eager": R.swiglu}
        if liger is not None:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            norm["liger"] = lambda x, weight, eps: _liger_rms_norm(liger, x, weight, eps)
            mlp["liger"] = lambda gate, up: LigerSiLUMulFunction.apply(gate, up)
        shape = f"{rows}x{cols}"
        cases.append(Case("rms_norm", shape, norm_inputs, norm, 2 * nbytes, 5 * nbytes))
        cases.append(Case("swiglu", shape, mlp_inputs, mlp, 3 * nbytes, 8 * nbytes))
    n, h = sizes["tokens"], sizes["hidden"]

    def add_norm_inputs():
        return {"x": m.randn(n, h), "residual": m.randn(n, h), "weight": m.randn(h), "eps": 1e-6}

    impls = {"triton": _triton(K.fused_add_rms_norm), "eager": R.fused_add_rms_norm}
    nbytes = n * h * m.size
    cases.append(
        Case("fused_add_rms_norm", f"{n}x{h}", add_norm_inputs, impls, 4 * nbytes, 8 * nbytes)
    )
    return cases


def _rope_case(sizes: dict, m: _Maker, liger) -> Case:
    import d9d.kernels as K
    from d9d.kernels import _reference as R

    n, (q_heads, k_heads, head_dim) = sizes["tokens"], sizes["heads"]

    def inputs():
        angles = torch.randn(n, head_dim // 2, device=m.device)
        angles = torch.cat([angles, angles], dim=-1)
        q, k = m.randn(1, n, q_heads, head_dim), m.randn(1, n, k_heads, head_dim)
        return {"q": q, "k": k, "cos": angles.cos(), "sin": angles.sin()}

    impls = {"triton": _triton(K.rope), "eager": R.rope}
    if liger is not None:
        impls["liger"] = lambda q, k, cos, sin: liger.liger_rotary_pos_emb(
            q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None]
        )
    qk = n * (q_heads + k_heads) * head_dim * m.size
    tables = 2 * n * head_dim * 4
    shape = f"{n}x({q_heads}+{k_heads})x{head_dim}"
    return Case("rope", shape, inputs, impls, 2 * qk + tables, 4 * qk + 2 * tables)


def _loss_cases(sizes: dict, m: _Maker, liger) -> list[Case]:
    import d9d.kernels as K
    from d9d.kernels import _reference as R

    n, h, v = sizes["tokens"], sizes["hidden"], sizes["vocab"]

    def ce_inputs():
        return {"logits": m.randn(n, v, scale=4.0), "labels": m.labels(n, v), "ignore_index": -100}

    def flce_inputs():
        weight = m.randn(v, h, scale=h**-0.5)
        return {
            "hidden": m.randn(n, h),
            "weight": weight,
            "labels": m.labels(n, v),
            "ignore_index": -100,
            "chunk_size": 1024,
        }

    # "eager" is d9d's reference (float32 math); "torch" is F.cross_entropy in the logits'
    # dtype, the leaner baseline the memory target is measured against.
    ce = {
        "triton": _triton(K.cross_entropy),
        "eager": R.cross_entropy,
        "torch": lambda logits, labels, ignore_index: F.cross_entropy(
            logits, labels, ignore_index=ignore_index
        ),
    }
    flce = {
        "triton": _triton(K.fused_linear_cross_entropy),
        "eager": R.fused_linear_cross_entropy,
        "torch": lambda hidden, weight, labels, ignore_index, chunk_size: F.cross_entropy(
            F.linear(hidden, weight), labels, ignore_index=ignore_index
        ),
    }
    if liger is not None:
        ce["liger"] = lambda logits, labels, ignore_index: liger.LigerCrossEntropyLoss(
            ignore_index=ignore_index
        )(logits, labels)
        flce["liger"] = lambda hidden, weight, labels, ignore_index, chunk_size: (
            liger.LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index)(
                weight, hidden, labels
            )
        )
    logits = n * v * m.size
    operands = (n * h + v * h) * m.size
    return [
        Case("cross_entropy", f"{n}x{v}", ce_inputs, ce, logits, 3 * logits, memory=True),
        Case(
            "fused_linear_cross_entropy",
            f"{n}x{h}x{v}",
            flce_inputs,
            flce,
            operands,
            2 * operands,
            flops_fwd=2 * n * h * v,  # the logits
            flops_fwd_bwd=6 * n * h * v,  # the logits, grad of hidden, grad of weight
            memory=True,
        ),
    ]


def _adamw_case(sizes: dict, m: _Maker) -> Case:
    """AdamW over one Llama decoder layer's params in float32 (read p, g, m, v; write p, m, v)."""
    import d9d.kernels as K
    from d9d.kernels import _reference as R

    h, f, (_, k_heads, head_dim) = sizes["hidden"], sizes["mlp"], sizes["heads"]
    kv = k_heads * head_dim
    layer = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
    hyper = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}

    def inputs():
        p, g, mu, nu = ([torch.randn(s, device=m.device) for s in layer] for _ in "pgmv")
        return {"params": p, "grads": g, "exp_avgs": mu, "exp_avg_sqs": [t.abs() for t in nu]}

    def triton(**kw):
        K.adamw(**kw, lr=1e-4, step=1, backend="triton", **hyper)

    def eager(**kw):
        one = torch.ones((), device=m.device)
        R.adamw(**kw, lr=one * 1e-4, step=one, **hyper)

    elements = sum(torch.Size(s).numel() for s in layer)
    impls = {"triton": triton, "eager": eager}
    return Case("adamw", "llama3-8b-layer-fp32", inputs, impls, 7 * 4 * elements, None)


def _cases(sizes: dict, dtype: torch.dtype, device: str, smoke: bool) -> list[Case]:
    liger = None if smoke else _liger()
    maker = _Maker(dtype, device)
    return [
        *_norm_and_mlp_cases(sizes, maker, liger),
        _rope_case(sizes, maker, liger),
        *_loss_cases(sizes, maker, liger),
        _adamw_case(sizes, maker),
    ]


def _liger_rms_norm(liger, x, weight, eps):
    module = liger.LigerRMSNorm(weight.shape[0], eps=eps).to(device=x.device, dtype=weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module(x)


def _timer(device: str) -> Callable[[Callable[[], object], int, int], list[float]]:
    def run(fn, warmup, reps):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            if device == "cuda":
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                start_s = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start_s)
        return times

    return run


def _tensors(out) -> list[torch.Tensor]:
    outs = out if isinstance(out, tuple | list) else (out,)
    return [t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]


def _step(fn, inputs: dict, backward: bool) -> Callable[[], object]:
    """Forward only (under no_grad, so nothing is saved for a backward), or forward+backward."""
    leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        if not backward:
            with torch.no_grad():
                return fn(**inputs)
        outs = _tensors(fn(**inputs))
        return torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])

    return step


def _peak_memory(step, device: str) -> int | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _copy_bandwidth(device: str, nbytes: int, warmup: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = _timer(device)(lambda: dst.copy_(src), warmup, reps)
    return 2 * nbytes / statistics.median(times) / 1e9


def _measure(case: Case, args, device: str, copy_gbps: float) -> list[dict]:
    rows = []
    modes = [("fwd", False)] + ([("fwd+bwd", True)] if case.bytes_fwd_bwd is not None else [])
    impls = dict(case.impls)
    if not args.no_compile and not args.cpu_smoke:
        impls["compile"] = torch.compile(case.impls["eager"])
    for mode, backward in modes:
        for name, fn in impls.items():
            row = {"op": case.op, "shape": case.shape, "mode": mode, "impl": name}
            try:
                inputs = case.make()
                step = _step(fn, inputs, backward)
                median = statistics.median(_timer(device)(step, args.warmup, args.reps))
                nbytes = case.bytes_fwd_bwd if backward else case.bytes_fwd
                gbps = nbytes / median / 1e9
                row["median_ms"] = _round(median * 1e3)
                row["gbps"] = _round(gbps)
                row["pct_of_copy"] = _round(100 * gbps / copy_gbps)
                flops = case.flops_fwd_bwd if backward else case.flops_fwd
                if flops:
                    row["tflops"] = _round(flops / median / 1e12)
                if backward and case.memory:
                    row["peak_memory_bytes"] = _peak_memory(step, device)
                del inputs, step
            except Exception as error:  # one failing implementation is a result, not a crash
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _check(name: str, value: float, ok: bool) -> dict:
    return {"check": name, "value": value, "ok": ok}


def _checks(rows: list[dict]) -> list[dict]:
    """The issue's targets, evaluated on these rows."""
    by_key = {(r["op"], r["shape"], r["mode"], r["impl"]): r for r in rows if "error" not in r}
    checks = []
    for (op, shape, mode, impl), row in by_key.items():
        if impl != "triton":
            continue
        if op in ("rms_norm", "swiglu") and mode == "fwd":
            name = f"{op} {shape} fwd >= 85% of copy bandwidth"
            checks.append(_check(name, row["pct_of_copy"], row["pct_of_copy"] >= 85))
        compiled = by_key.get((op, shape, mode, "compile"))
        if compiled is not None:
            speedup = _round(compiled["median_ms"] / row["median_ms"])
            name = f"{op} {shape} {mode} at least as fast as compile (speedup)"
            checks.append(_check(name, speedup, row["median_ms"] <= compiled["median_ms"]))
        baseline = by_key.get((op, shape, mode, "torch"), {})
        if op == "fused_linear_cross_entropy" and baseline.get("peak_memory_bytes"):
            ratio = _round(row["peak_memory_bytes"] / baseline["peak_memory_bytes"])
            name = f"{op} {shape} peak memory < 1/4 of eager F.linear + F.cross_entropy"
            checks.append(_check(name, ratio, ratio < 0.25))
    return checks


def _round(x: float) -> float:
    """Four significant digits."""
    return float(f"{x:.4g}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", default="", help="comma-separated ops, e.g. rms_norm,swiglu")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, interpreter")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv_used = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv_used)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel is decorated
        device, sizes, args.warmup, args.reps = "cpu", SMOKE, 1, 2
    elif torch.cuda.is_available():
        device, sizes = "cuda", LLAMA3_8B
    else:
        print(
            "benchmarks/kernels.py needs a CUDA device and found none; "
            "run with --cpu-smoke for a tiny check of the code path on CPU",
            file=sys.stderr,
        )
        return 2
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu-smoke"
    copy_bytes = 1 << (30 if device == "cuda" else 20)
    copy_gbps = _copy_bandwidth(device, copy_bytes, args.warmup, args.reps)
    only = set(filter(None, args.only.split(",")))
    cases = _cases(sizes, getattr(torch, args.dtype), device, args.cpu_smoke)
    cases = [case for case in cases if not only or case.op in only]
    rows = [row for case in cases for row in _measure(case, args, device, copy_gbps)]
    report = {
        "benchmark": "kernels",
        "device": name,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "liger_kernel": _version("liger-kernel"),
        "commit": _commit(),
        "command": " ".join(["python", "benchmarks/kernels.py", *argv_used]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {"dtype": args.dtype, "warmup": args.warmup, "reps": args.reps, "sizes": sizes},
        "copy_gbps": _round(copy_gbps),
        "results": rows,
        # The targets are for a GPU at Llama sizes: meaningless at smoke sizes.
        "checks": [] if args.cpu_smoke else _checks(rows),
    }
    slug = name.lower().replace(" ", "-")
    out = args.out or Path(__file__).parent / "results" / f"kernels-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"copy bandwidth {copy_gbps:.1f} GB/s; wrote {out}")
    for check in report["checks"]:
        print(("PASS " if check["ok"] else "FAIL ") + f"{check['check']}: {check['value']}")
    return 0


def _commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
