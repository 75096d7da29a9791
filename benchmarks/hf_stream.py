"""Peak host memory per rank when a sharded run loads a Hugging Face Llama folder.

The folder is a random fp32 Llama with Llama 3.2 1B block shapes (``--layers`` blocks,
vocab cut to ``--vocab``; >= 1 GB by default), written by ``d9d.checkpoint.export_hf``.
``--world`` ranks (forked processes, gloo, one thread each) place it under
``shard_params`` (``fsdp=--world``), two ways, each rank in a fresh process per way:

  streamed  model built on ``meta``, ``step.place`` of it as the target,
            ``import_hf(folder, target=placed)``: each rank reads only its slices.
  full      ``import_hf(folder)`` (the whole state dict), then ``step.place`` of it.

Per rank: peak resident-set growth during the load (``d9d.testing.peak_rss_growth``:
``VmHWM`` after resetting it through ``/proc/self/clear_refs``, so file pages an mmap
faulted in count), as bytes and as a multiple of the model's and of the rank's shard
bytes, and the load's wall time. The page cache is warm (the folder was just written).

    python benchmarks/hf_stream.py --out benchmarks/results/hf_stream-cpu.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from report import provenance, write_report

import d9d
from d9d import checkpoint
from d9d.models import Llama, LlamaConfig
from d9d.testing import peak_rss_growth, run_on_ranks


def _config(layers: int, vocab: int) -> LlamaConfig:
    return LlamaConfig.llama_1b(n_layers=layers, vocab_size=vocab)


def _write_folder(config: LlamaConfig, folder: Path) -> int:
    """Write a random Llama of ``config`` to ``folder``; return its bytes."""
    generator = torch.Generator().manual_seed(0)
    shapes = {path: p.shape for path, p in Llama(config, device="meta").named_parameters()}
    params = {path: torch.randn(shape, generator=generator) for path, shape in shapes.items()}
    checkpoint.export_hf(params, config, folder)
    return sum(p.numel() * p.element_size() for p in params.values())


def _step(world: int) -> Any:
    mesh = d9d.make_mesh("cpu", fsdp=world)

    @d9d.shard_params(mesh, "fsdp")
    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        return params, opt_state, {}

    return step


def _streamed(folder: Path, step: Any) -> dict[str, Any]:
    config = checkpoint.read_hf_config(folder)
    model = d9d.functionalize(Llama(config, device="meta"))
    target, _ = step.place(model.params, (), model=model)
    return checkpoint.import_hf(folder, target=target)[1]


def _full(folder: Path, step: Any) -> dict[str, Any]:
    config, params = checkpoint.import_hf(folder)
    model = d9d.functionalize(Llama(config, device="meta"))
    return step.place(params, (), model=model)[0]


def _rank(way: str, folder: Path, world: int) -> dict[str, float]:
    load = {"streamed": _streamed, "full": _full}[way]
    step = _step(world)  # outside the measure: building it imports torch._inductor (~100 MB)
    start = time.perf_counter()
    placed, grown = peak_rss_growth(load, folder, step)
    seconds = time.perf_counter() - start
    shard = sum(p.to_local().numel() * p.element_size() for p in placed.values())
    return {"peak_rss_growth_bytes": grown, "shard_bytes": shard, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: /tmp)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hf_stream-cpu.json"))
    args = parser.parse_args()
    config = _config(args.layers, args.vocab)
    root = Path(tempfile.mkdtemp(prefix="d9d-hf-stream-", dir=args.dir))
    try:
        model_bytes = _write_folder(config, root / "hf")
        results = []
        for way in ("streamed", "full"):
            ranks = run_on_ranks(_rank, args.world, way, root / "hf", args.world, method="fork")
            for rank, r in enumerate(ranks):
                grown = r["peak_rss_growth_bytes"]
                results.append(
                    {
                        "way": way,
                        "rank": rank,
                        "peak_rss_growth_MB": round(grown / 1e6, 1),
                        "x_model": round(grown / model_bytes, 3),
                        "x_shard": round(grown / r["shard_bytes"], 3),
                        "seconds": round(r["seconds"], 3),
                    }
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {
        **provenance(
            "hf_stream",
            args,
            f"cpu ({platform.machine()}, {args.world} gloo ranks by fork, 1 thread each)",
            safetensors=importlib.metadata.version("safetensors"),
        ),
        "config": {
            "model": f"Llama 3.2 1B shapes, {args.layers} block(s), vocab {args.vocab}, fp32",
            "model_bytes": model_bytes,
            "layout": f"shard_params over fsdp={args.world}",
        },
        "results": results,
    }
    write_report(args.out, report)
    print(f"model: {model_bytes / 1e6:.0f} MB")
    print(
        "| way | rank | peak RSS growth (MB) | x model | x shard | s |\n|---|---|---|---|---|---|"
    )
    for r in results:
        print(
            f"| {r['way']} | {r['rank']} | {r['peak_rss_growth_MB']} | {r['x_model']} | "
            f"{r['x_shard']} | {r['seconds']} |"
        )


if __name__ == "__main__":
    main()
