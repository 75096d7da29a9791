"""Model FLOPs utilization of one training step on one GPU: d9d against what users run today.

Variants, each training the same Llama shapes on the same batches:

- ``d9d``: ``d9d.jit`` of the whole step (``make_train_step``: forward, cross entropy, grads,
  AdamW), the kernel registry's automatic backends inside the model (Triton RMSNorm, RoPE,
  SwiGLU on CUDA), SDPA attention, ``d9d.remat`` with ``--remat``.
- ``transformers``: ``LlamaForCausalLM`` of the same config with SDPA, ``torch.compile`` of
  the model, ``torch.optim.AdamW(fused=True)``: the baseline a user writes instead. It starts
  from d9d's weights (``llama_to_hf``), so the first losses agree.
- ``torchtitan``: its Llama 3 model (``llama3_configs``, flex attention: 0.3.0 refuses SDPA
  for language models) cut to the same layers, ``torch.compile`` per block as torchtitan
  applies it, fused AdamW. Recorded as unavailable,
  with the reason, where torchtitan does not install or run on this torch.

Params, grads and optimizer state are in ``--dtype`` (bfloat16 on CUDA: pure bf16 training,
the same for every variant). Each variant runs in its own process on CUDA, so its peak memory
is its own and an out-of-memory ends only that variant. ``--batch auto`` doubles the batch
from ``--min-batch`` while the d9d variant fits and runs every other variant at the largest
one (the d9d row is the search's own run there).

Reported per variant: median step time and its spread, tokens/s, MFU (training FLOPs
``LlamaConfig.flops_per_token``, ``6 * N`` plus attention, against the device's dense bf16
peak from ``d9d train``'s table: 989 TFLOP/s for H100 and H200 SXM, 756 for H100 PCIe, 312
for A100; none for other devices), peak memory,
and the losses of the timed steps. JSON out:

    python benchmarks/mfu.py --preset 1b --seq 4096 --batch auto --out benchmarks/results/mfu-h100.json
    python benchmarks/mfu.py --preset 8b --layers 8 --seq 4096 --remat full
    python benchmarks/mfu.py --device cpu --dtype float32 --eager --preset tiny --seq 32 --batch 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import d9d
from d9d.checkpoint._hf import _hf_config, llama_to_hf
from d9d.cli._flops import peak_bf16_flops
from d9d.cli._train_step import make_train_step
from d9d.models import Llama, LlamaConfig

VARIANTS = ("d9d", "transformers", "torchtitan")
LR = 3e-4
WEIGHT_DECAY = 0.1

Run = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of ``device`` (``d9d train``'s table), or None where it has none."""
    return peak_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def model_config(args: argparse.Namespace) -> LlamaConfig:
    """The preset, cut to ``--layers`` blocks, long enough for ``--seq``."""
    base = LlamaConfig.preset(args.preset)
    layers = args.layers or base.n_layers
    return LlamaConfig.preset(args.preset, n_layers=layers, max_seq_len=max(args.seq, 1))


def batches(config: LlamaConfig, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """``warmup + steps`` random token batches, the same for every variant."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.warmup + args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=generator)
        ids = ids.to(device)
        out.append({"tokens": ids[:, :-1], "labels": ids[:, 1:]})
    return out


def _d9d_weights(config: LlamaConfig, device: torch.device, dtype: torch.dtype) -> d9d.Model:
    return d9d.functionalize(Llama(config, device=device).to(dtype))


def _one_rank_mesh(device: torch.device) -> torch.distributed.DeviceMesh:
    """A mesh of this one process, for ``remat`` (which needs a mesh to plan on)."""
    if not torch.distributed.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group(backend, store=store, rank=0, world_size=1)
    return d9d.make_mesh(device.type, dp=1)


def build_d9d(config: LlamaConfig, args: argparse.Namespace, device: torch.device) -> Run:
    model = _d9d_weights(config, device, getattr(torch, args.dtype))
    opt = d9d.optim.adamw(LR, weight_decay=WEIGHT_DECAY)
    step = make_train_step(model, opt)
    if args.remat != "none":
        step = d9d.remat(args.remat, mesh=_one_rank_mesh(device))(step)
    if not args.eager:
        step = d9d.jit(step)
    state = {"params": model.params}
    state["opt"] = opt.init(state["params"])

    def run(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        state["params"], state["opt"], metrics = step(state["params"], state["opt"], batch)
        return metrics["loss"]

    return run


def _torch_step(module: torch.nn.Module, forward: Callable, args: argparse.Namespace) -> Run:
    """``loss.backward()`` and a fused AdamW step: the loop users write by hand."""
    fused = {"fused": True} if args.device == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **fused)

    def run(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = forward(batch["tokens"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return run


def build_transformers(config: LlamaConfig, args: argparse.Namespace, device: torch.device) -> Run:
    import transformers

    dtype = getattr(torch, args.dtype)
    hf_config = transformers.LlamaConfig(**_hf_config(config, dtype))
    hf_config._attn_implementation = "sdpa"
    with torch.device(device):
        module = transformers.LlamaForCausalLM(hf_config)
    rotary = module.model.rotary_emb
    module.to(dtype)
    rotary.inv_freq = rotary.original_inv_freq = rotary.original_inv_freq.float()  # kept fp32
    weights = _d9d_weights(config, device, dtype).params
    module.load_state_dict(llama_to_hf(weights, config), strict=not config.tie_embeddings)
    forward = module if args.eager else torch.compile(module)
    return _torch_step(module, lambda tokens: forward(input_ids=tokens).logits, args)


def build_torchtitan(config: LlamaConfig, args: argparse.Namespace, device: torch.device) -> Run:
    from torchtitan.models.llama3 import llama3_configs

    flavor = {"1b": "1B", "8b": "8B"}.get(args.preset)
    if flavor is None:
        raise ValueError(f"torchtitan has no flavor for preset {args.preset!r}")
    titan = llama3_configs[flavor](attn_backend="flex")  # 0.3.0 refuses sdpa for LMs
    titan.layers = titan.layers[: config.n_layers]
    with torch.device("meta"):
        module = titan.build()
    module.to_empty(device=device)
    with torch.no_grad():
        module.init_states(buffer_device=device)
    module.to(getattr(torch, args.dtype))
    if not args.eager:
        for name, block in module.layers.named_children():
            module.layers.register_module(name, torch.compile(block))

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        masks = module.get_attention_masks(positions=positions)  # per step, as its trainer does
        return module(tokens, positions, masks)

    return _torch_step(module, forward, args)


BUILDERS = {"d9d": build_d9d, "transformers": build_transformers, "torchtitan": build_torchtitan}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build ``variant``, run its warm-up steps, then time ``args.steps`` steps."""
    device = torch.device(args.device)
    config = model_config(args)
    data = batches(config, args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = BUILDERS[variant](config, args, device)
    losses, times = [], []
    for index, batch in enumerate(data):
        _sync(device)
        start = time.perf_counter()
        loss = run(batch)
        _sync(device)
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
            losses.append(float(loss))
    tokens = args.batch * args.seq
    median = statistics.median(times)
    flops = config.flops_per_token(args.seq) * tokens
    peak = peak_flops(device)
    row = {
        "variant": variant,
        "batch": args.batch,
        "seq": args.seq,
        "step_ms_median": round(median * 1e3, 2),
        "step_ms_stdev": round(statistics.pstdev(times) * 1e3, 2),
        "step_ms_min": round(min(times) * 1e3, 2),
        "step_ms_max": round(max(times) * 1e3, 2),
        "tokens_per_s": round(tokens / median, 1),
        "tflop_per_s": round(flops / median / 1e12, 2),
        "mfu": None if peak is None else round(flops / median / peak, 4),
        "losses": [round(value, 4) for value in losses],
    }
    if device.type == "cuda":
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return row


def _without_batch(argv: list[str]) -> list[str]:
    """``argv`` less its ``--batch`` option and the option's value."""
    out, value_next = [], False
    for arg in argv:
        if value_next or arg.startswith("--batch="):
            value_next = False
        elif arg == "--batch":
            value_next = True
        else:
            out.append(arg)
    return out


def _isolated(variant: str, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """``measure`` in a fresh process: its own peak memory, and an OOM ends only it."""
    argv = [sys.executable, __file__, *args.argv, "--batch", str(batch), "--only", variant]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
    out_of_memory = "OutOfMemoryError" in done.stderr or "out of memory" in done.stderr
    return {
        "variant": variant,
        "batch": batch,
        "error": "out of memory" if out_of_memory else tail[0],
    }


def _largest_batch(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """The largest batch ``--min-batch * 2**k`` (up to ``--max-batch``) at which the d9d variant
    runs, and the d9d row measured there (each try is a whole measured run: no need to repeat).
    Where even ``--min-batch`` fails, that batch and the d9d row's error: the other variants
    still run there."""
    batch, fits, row = args.min_batch, None, {}
    while batch <= args.max_batch:
        row = _isolated("d9d", args, batch)
        print(json.dumps(row | {"auto_batch_try": True}), flush=True)
        if "error" in row:
            break
        fits, batch = row, 2 * batch
    if fits is None:
        return args.min_batch, row
    return fits["batch"], fits


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="1b", help="a LlamaConfig preset (default 1b)")
    parser.add_argument("--layers", type=int, default=None, help="blocks kept (default all)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", default="auto", help="sequences per step, or auto")
    parser.add_argument("--min-batch", type=int, default=1, help="first batch auto tries")
    parser.add_argument("--max-batch", type=int, default=64, help="largest batch auto tries")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation)")
    parser.add_argument("--remat", choices=("none", "full", "selective"), default="none")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on cuda, else float32")
    parser.add_argument("--eager", action="store_true", help="no compilation (smoke runs)")
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one variant, in-process
    parser.add_argument("--out", type=Path, default=None)
    return parser


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.argv = _without_batch(argv)
    if args.only is not None:
        args.batch = int(args.batch)
        print(json.dumps(measure(args.only, args)), flush=True)
        return 0
    isolate = args.device == "cuda"
    measured = {}
    if args.batch == "auto" and isolate:
        args.batch, measured["d9d"] = _largest_batch(args)
    args.batch = 8 if args.batch == "auto" else int(args.batch)
    rows = []
    for variant in args.variants.split(","):
        if variant in measured:
            row = measured[variant]
        elif isolate:
            row = _isolated(variant, args, args.batch)
        else:
            try:
                row = measure(variant, args)
            except ImportError as error:
                row = {"variant": variant, "batch": args.batch, "error": f"unavailable: {error}"}
            except Exception as error:  # a variant that fails is a result, as on CUDA
                row = {"variant": variant, "batch": args.batch, "error": repr(error)[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    config = model_config(args)
    report = {
        "benchmark": "mfu",
        "device": name or device.type,
        "torch": torch.__version__,
        "commit": _commit(),
        "command": " ".join(["python", "benchmarks/mfu.py", *argv]),
        "config": {"preset": args.preset, "n_layers": config.n_layers, "params": config.num_params},
        "dtype": args.dtype,
        "flops_per_token": config.flops_per_token(args.seq),
        "peak_flops": peak_flops(device),
        "rows": rows,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
