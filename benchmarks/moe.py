"""MoE benchmark: the d9d MoE layer against ``transformers``' Qwen3-MoE block, grouped GEMM
TFLOP/s per backend, and ``moe_permute``/``moe_unpermute`` GB/s against copy bandwidth.

Three sections, one JSON (``benchmarks/results/moe-<device>.json``):

- ``layer``: ``d9d.moe.MoE`` forward + backward against ``Qwen3MoeSparseMoeBlock`` with its
  ``grouped_mm`` experts (what ``from_pretrained`` picks by default), on OLMoE-1B-7B-like and
  Qwen3-30B-A3B-like layer shapes, with the same weights copied across. Before timing, they
  are checked to compute the same function: outputs, input and router grads agree in the
  timed dtype on the timed tokens, and d9d agrees with the block's ``eager`` per-expert loop
  in float64 at width 128. ``--eager`` also times the ``eager`` experts: their backward
  writes a zero-filled grad of every expert's weights for each expert a batch reaches
  (indexing ``gate_up_proj[e]``), so one call takes minutes at these shapes on a CPU.
- ``grouped_gemm``: one expert projection ``[T*top_k, H] x [E, H, I]``, forward and forward +
  backward, per backend: ``torch`` (``torch._grouped_mm``), ``loop`` (a Python loop over the
  experts' row slices, the sizes read on the host: what one writes without a grouped kernel),
  the registry's ``reference`` (a masked loop doing ``E`` times the work, no host sync: a
  correctness reference, timed on fewer tokens), and ``triton`` on CUDA only. TFLOP/s count
  the useful work, ``2 * T * top_k * H * I`` forward and three times that forward + backward.
- ``permute``: ``moe_permute`` and ``moe_unpermute`` forward, GB/s from the bytes each must
  read and write (every row it copies read and written once, plus the index and weight
  tensors), against ``torch.empty_like(src).copy_(src)`` of a buffer moving the same bytes.

Variants of one comparison are interleaved (one rep of each in turn, the order rotating) and
reported with their ratios, so that load from other processes on a shared machine hits them
alike; compare ratios, not absolute times, across runs. On CPU the Triton backends run only
under the interpreter (``TRITON_INTERPRET=1``), a correctness tool: not timed.

    python benchmarks/moe.py                                  # minutes on 2 CPU cores
    python benchmarks/moe.py --layer-tokens 128 --gemm-tokens 256 --reps 3 --out /tmp/moe.json
    python benchmarks/moe.py --shapes tiny --out /tmp/moe.json      # seconds: the code path only
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from d9d.kernels import grouped_gemm, moe_permute, moe_unpermute
from d9d.moe import MoE, MoEConfig

# Real layer shapes: (experts, top-k, hidden, expert hidden, top-k weights renormalized).
SHAPES = {
    "olmoe-1b-7b": dict(n_experts=64, top_k=8, dim=2048, expert_dim=1024, norm_topk=False),
    "qwen3-30b-a3b": dict(n_experts=128, top_k=8, dim=2048, expert_dim=768, norm_topk=True),
}
# ``--shapes tiny``: the same code at sizes that take seconds on a CPU (benchmarks/gpu's smoke run).
TINY_SHAPES = {"tiny": dict(n_experts=5, top_k=2, dim=32, expert_dim=24, norm_topk=True)}
MACHINE_NOTE = (
    "CPU runs: a 2-core x86_64 machine shared with about 6 other agents' processes; variants "
    "are interleaved and their ratios are the figures to compare, absolute times vary with load."
)
TRITON_NOTE = (
    "Triton backends are timed on CUDA only; on CPU they run only under TRITON_INTERPRET=1, a "
    "Python interpreter of the kernel meant for correctness tests, whose speed means nothing."
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(
    variants: dict[str, Callable[[], object]], device: torch.device, warmup: int, reps: int
) -> dict[str, list[float]]:
    """Seconds per call of each variant: ``warmup`` untimed rounds, then ``reps`` rounds of one
    call each, the order rotated every round."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            _sync(device)
            start = time.perf_counter()
            variants[name]()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def _summary(times: list[float]) -> dict[str, float]:
    return {
        "median_ms": round(statistics.median(times) * 1e3, 3),
        "min_ms": round(min(times) * 1e3, 3),
        "reps": len(times),
    }


# --- layer: d9d.moe.MoE against transformers' Qwen3MoeSparseMoeBlock --------------------------


def _layer_pair(shape: dict, device: torch.device) -> tuple[MoE, Qwen3MoeSparseMoeBlock]:
    """A d9d layer and a Qwen3-MoE block holding the same weights, in float32."""
    layer = MoE(MoEConfig(**shape), device=device)
    hf_config = Qwen3MoeConfig(
        hidden_size=shape["dim"],
        moe_intermediate_size=shape["expert_dim"],
        num_experts=shape["n_experts"],
        num_experts_per_tok=shape["top_k"],
        norm_topk_prob=shape["norm_topk"],
        hidden_act="silu",
    )
    block = Qwen3MoeSparseMoeBlock(hf_config).to(device)
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        gate_up = torch.cat([layer.experts.w_gate, layer.experts.w_up], dim=2)  # [E, H, 2I]
        block.experts.gate_up_proj.copy_(gate_up.transpose(1, 2))
        block.experts.down_proj.copy_(layer.experts.w_down.transpose(1, 2))
    return layer, block


def _fwd_bwd(module: torch.nn.Module, x: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    """Forward, then backward of ``<out, probe>``; returns ``out`` (grads land on x, params)."""
    out = module(x)
    out = out.out if isinstance(module, MoE) else out
    (out * probe).sum().backward()
    return out


def _variants(layer: MoE, block: Qwen3MoeSparseMoeBlock) -> dict[str, Callable]:
    """``{name: (x, probe) -> (out, x.grad, router.grad)}``: d9d, and the block with its
    ``grouped_mm`` and ``eager`` experts (one set of weights, the implementation switched per
    call, so that three copies of up to 2.4 GB of experts need not coexist)."""

    def d9d(x: torch.Tensor, probe: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _run(layer, layer.router.weight, x, probe)

    def transformers_with(implementation: str) -> Callable:
        def call(x: torch.Tensor, probe: torch.Tensor) -> tuple[torch.Tensor, ...]:
            block.experts.config._experts_implementation = implementation
            return _run(block, block.gate.weight, x, probe)

        return call

    return {
        "d9d": d9d,
        "transformers grouped_mm": transformers_with("grouped_mm"),
        "transformers eager": transformers_with("eager"),
    }


def _run(
    module: torch.nn.Module, router: torch.Tensor, x: torch.Tensor, probe: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_(True)
    out = _fwd_bwd(module, x, probe)
    result = (out.detach(), x.grad, router.grad)
    module.zero_grad(set_to_none=True)
    return result


def _check_same_function(
    variants: dict[str, Callable], x: torch.Tensor, tol: float
) -> dict[str, float]:
    """Assert every variant's output, input grad and router grad equal d9d's on ``x`` within
    ``tol`` of the largest value; returns each variant's largest relative difference."""
    probe = torch.randn(x.shape, dtype=x.dtype, device=x.device)
    results = {name: variant(x, probe) for name, variant in variants.items()}
    errors = {}
    for name, result in results.items():
        errors[name] = 0.0
        for what, ours, theirs in zip(
            ("out", "x.grad", "router.grad"), results["d9d"], result, strict=True
        ):
            error = (ours - theirs).abs().max().item() / theirs.abs().max().item()
            if not error <= tol:
                raise AssertionError(
                    f"d9d MoE and {name} disagree on {what} in {x.dtype}: max difference "
                    f"{error:.3g} of the largest value, over the tolerance {tol}"
                )
            errors[name] = max(errors[name], error)
    return errors


def _float64_check(shape: dict, device: torch.device) -> dict[str, float]:
    """The float64 agreement of d9d and the eager block on the shape's experts and top-k at a
    width of 128 (float64 runs d9d's reference grouped GEMM, ``E`` times the work, and
    ``torch._grouped_mm`` has no float64, so the ``grouped_mm`` block is checked in float32).
    transformers' router takes its softmax in float32 whatever the dtype, so agreement stops
    at float32 rounding of the routing weights."""
    narrow = shape | dict(dim=128, expert_dim=96)
    layer, block = (m.double() for m in _layer_pair(narrow, device))
    variants = {k: v for k, v in _variants(layer, block).items() if k != "transformers grouped_mm"}
    x = torch.randn(1, 37, 128, dtype=torch.float64, device=device)
    return _check_same_function(variants, x, 1e-6)


def bench_layer(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list:
    rows = []
    for name, shape in args.shape_set.items():
        exact = _float64_check(shape, device)
        layer, block = (m.to(dtype) for m in _layer_pair(shape, device))
        variants = _variants(layer, block)
        if not args.eager:
            del variants["transformers eager"]
        x = torch.randn(1, args.layer_tokens, shape["dim"], device=device, dtype=dtype)
        timed = _check_same_function(variants, x, args.tolerance)
        probe = torch.randn_like(x)
        calls = {k: functools.partial(v, x, probe) for k, v in variants.items()}
        times = interleaved(calls, device, args.warmup, args.reps)
        del layer, block, variants, calls
        base = statistics.median(times["d9d"])
        flops = 3 * 3 * 2 * args.layer_tokens * shape["top_k"] * shape["dim"] * shape["expert_dim"]
        for variant, samples in times.items():
            median = statistics.median(samples)
            row = {"shape": name, "variant": variant, "tokens": args.layer_tokens}
            row |= _summary(samples) | {
                "tokens_per_s": round(args.layer_tokens / median, 1),
                "expert_tflop_per_s": round(flops / median / 1e12, 4),
                "time_vs_d9d": round(median / base, 3),
                "max_rel_diff_float64_width128": exact.get(variant),
                f"max_rel_diff_{args.dtype}": timed[variant],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# --- grouped_gemm: TFLOP/s per backend -------------------------------------------------------


def _loop(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """One matmul per expert on its row slice; the sizes are read on the host (a sync)."""
    parts = x.split(group_sizes.tolist())
    return torch.cat([part @ w_e for part, w_e in zip(parts, w.unbind(0), strict=True)])


def _gemm_variants(
    backends: list[str], tokens: int, shape: dict, device: torch.device, dtype: torch.dtype
) -> dict[str, dict[str, Callable[[], None]]]:
    """``{mode: {backend: call}}`` on uniformly routed rows of ``tokens * top_k``."""
    experts, rows = shape["n_experts"], tokens * shape["top_k"]
    generator = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(experts, (rows,), device=device, generator=generator)
    group_sizes = torch.bincount(ids, minlength=experts).to(torch.int32)
    x = torch.randn(rows, shape["dim"], device=device, dtype=dtype, generator=generator)
    w = torch.randn(experts, shape["dim"], shape["expert_dim"], device=device, dtype=dtype)
    w = (w * 0.02).requires_grad_(True)
    x.requires_grad_(True)
    probe = torch.randn(rows, shape["expert_dim"], device=device, dtype=dtype)

    def gemm(backend: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        if backend == "loop":
            return _loop
        return lambda a, b, sizes: grouped_gemm(a, b, sizes, backend=backend)

    def forward(backend: str) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad():
                gemm(backend)(x, w, group_sizes)

        return call

    def forward_backward(backend: str) -> Callable[[], None]:
        def call() -> None:
            (gemm(backend)(x, w, group_sizes) * probe).sum().backward()
            x.grad = w.grad = None

        return call

    return {
        "fwd": {backend: forward(backend) for backend in backends},
        "fwd+bwd": {backend: forward_backward(backend) for backend in backends},
    }


def bench_grouped_gemm(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list:
    rows = []
    fast = ["torch", "loop"] + (["triton"] if device.type == "cuda" else [])
    runs = [(args.gemm_tokens, fast), (args.reference_tokens, [*fast, "reference"])]
    for name, shape in args.shape_set.items():
        for tokens, backends in runs:
            per_mode = _gemm_variants(backends, tokens, shape, device, dtype)
            flops = 2 * tokens * shape["top_k"] * shape["dim"] * shape["expert_dim"]
            for mode, variants in per_mode.items():
                times = interleaved(variants, device, args.warmup, args.reps)
                base = statistics.median(times["torch"])
                for backend, samples in times.items():
                    median = statistics.median(samples)
                    work = flops * (3 if mode == "fwd+bwd" else 1)
                    row = {"shape": name, "mode": mode, "backend": backend, "tokens": tokens}
                    row |= _summary(samples) | {
                        "tflop_per_s": round(work / median / 1e12, 4),
                        "time_vs_torch": round(median / base, 3),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


# --- permute / unpermute: GB/s against copy --------------------------------------------------


PERMUTE_BACKENDS = {"moe_permute": ("reference",), "moe_unpermute": ("torch", "reference")}


def _permute_calls(
    tokens: int, shape: dict, device: torch.device, dtype: torch.dtype
) -> dict[str, tuple[dict[str, Callable[[], object]], int]]:
    """``{op: ({backend: call}, bytes)}``: bytes count every copied row read and written once,
    plus the index and weight tensors. Triton runs on CUDA only (see ``TRITON_NOTE``)."""
    k, dim, experts = shape["top_k"], shape["dim"], shape["n_experts"]
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, dim, device=device, dtype=dtype, generator=generator)
    ids = torch.rand(tokens, experts, device=device, generator=generator).topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, device=device, generator=generator)
    permuted, _, row_map = moe_permute(x, ids, experts, backend="reference")
    row, index = x.element_size() * dim, 8 * tokens * k
    calls = {
        "moe_permute": functools.partial(moe_permute, x, ids, experts),
        "moe_unpermute": functools.partial(moe_unpermute, permuted, row_map, weights),
    }
    nbytes = {
        "moe_permute": 2 * tokens * k * row + 2 * index + 4 * experts,
        "moe_unpermute": tokens * k * row + tokens * row + index + 4 * tokens * k,
    }
    extra = ("triton",) if device.type == "cuda" else ()
    return {
        op: (
            {b: functools.partial(call, backend=b) for b in extra + PERMUTE_BACKENDS[op]},
            nbytes[op],
        )
        for op, call in calls.items()
    }


def _copy(source: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(source).copy_(source)


def bench_permute(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list:
    rows = []
    tokens = args.permute_tokens
    for name, shape in args.shape_set.items():
        for op, (calls, nbytes) in _permute_calls(tokens, shape, device, dtype).items():
            source = torch.randn(nbytes // 8, device=device)  # float32: reads + writes = nbytes
            times = interleaved(calls | {"copy": functools.partial(_copy, source)}, device,
                                args.warmup, args.reps)  # fmt: skip
            copy_time = statistics.median(times["copy"])
            for backend in calls:
                op_time = statistics.median(times[backend])
                row = {"shape": name, "op": op, "backend": backend, "tokens": tokens}
                row |= (
                    {"bytes": nbytes}
                    | _summary(times[backend])
                    | {
                        "gb_per_s": round(nbytes / op_time / 1e9, 3),
                        "copy_gb_per_s": round(8 * source.numel() / copy_time / 1e9, 3),
                        "fraction_of_copy": round(copy_time / op_time, 3),
                    }
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


# --- report ----------------------------------------------------------------------------------


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layer-tokens", type=int, default=128, help="tokens per layer call")
    parser.add_argument("--gemm-tokens", type=int, default=256, help="tokens (rows / top_k)")
    parser.add_argument("--reference-tokens", type=int, default=16, help="tokens, reference row")
    parser.add_argument("--permute-tokens", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="timed dtype; default float32 on CPU, bfloat16 on CUDA")  # fmt: skip
    parser.add_argument("--tolerance", type=float, default=None,
                        help="layer agreement in the timed dtype, relative to the largest value")  # fmt: skip
    parser.add_argument("--eager", action="store_true",
                        help="also time the Qwen3-MoE block's eager experts (minutes a call)")  # fmt: skip
    parser.add_argument("--only", default="layer,grouped_gemm,permute")
    parser.add_argument("--shapes", choices=("real", "tiny"), default="real",
                        help="real: OLMoE and Qwen3 layers; tiny: a smoke run in seconds")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv_used = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv_used)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    args.tolerance = args.tolerance or (2e-2 if args.dtype == "bfloat16" else 1e-4)
    args.shape_set = SHAPES if args.shapes == "real" else TINY_SHAPES
    dtype = getattr(torch, args.dtype)
    sections = {"layer": bench_layer, "grouped_gemm": bench_grouped_gemm, "permute": bench_permute}
    only = args.only.split(",")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report = {
        "benchmark": "moe",
        "device": f"{name} ({platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": _commit(),
        "command": " ".join(["python", "benchmarks/moe.py", *argv_used]),
        "dtype": args.dtype,
        "machine_note": MACHINE_NOTE if device.type == "cpu" else "",
        "triton_note": TRITON_NOTE,
        "shapes": args.shape_set,
        "tokens": {
            "layer": args.layer_tokens,
            "grouped_gemm": args.gemm_tokens,
            "grouped_gemm_reference": args.reference_tokens,
            "permute": args.permute_tokens,
            "why": "the default tokens are cut from the issue's T=8192 on CPU to keep the run "
            "to minutes (--gemm-tokens 8192 runs the GEMM at the issue's T); E, top-k, H and I "
            "are the real ones",
        },
        "warmup": args.warmup,
        "reps": args.reps,
    }
    failed = []
    for section, bench in sections.items():
        if section in only:
            try:
                report[section] = bench(args, device, dtype)
            except Exception as error:  # recorded; the other sections still run
                report[section] = []
                report[f"{section}_error"] = f"{type(error).__name__}: {error}"[:500]
                failed.append(section)
                print(f"section {section} failed: {report[f'{section}_error']}", file=sys.stderr)
    slug = "cpu" if device.type == "cpu" else name.lower().replace(" ", "-")
    out = args.out or Path(__file__).parent / "results" / f"moe-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
