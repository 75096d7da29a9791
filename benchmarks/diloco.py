"""Final loss of ``d9d.diloco`` (H inner steps, an outer SGD) against synchronous training.

Two replica groups (one process each, ``shard_params(fsdp=1)``) train the tiny Llama with
``d9d train``'s optimizer (AdamW, warmup and cosine decay, clipping) on their halves of every
global batch of the Python standard library's bytes, under ``d9d.diloco(manager,
inner_steps=H, outer=sgd(lr, momentum, nesterov=momentum > 0))`` on a real torchft
lighthouse, once per ``--outer LR:MOMENTUM`` (default: the DiLoCo paper's Nesterov, 0.7:0.9,
and plain averaging, 1:0). The synchronous baseline is one device fed both halves (what data
parallelism over the two groups computes) with the same optimizer. Every run starts from the
same seeded params and is scored on the same held-out windows. With ``--sync-steps S`` the
groups start DiLoCo from the synchronous run's params and optimizer state after its first S
steps (the DiLoCo paper starts from a pretrained model) and run it for the remaining steps;
with ``--warmup-steps W`` DiLoCo's own warm-up (``d9d.diloco(warmup_steps=W)``: an averaging
round after each of the first W steps) stands in for them. JSON out:

    python benchmarks/diloco.py --steps 200 --inner-steps 8 --out benchmarks/results/diloco-cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch
from report import provenance, write_report

import d9d
from d9d.cli._config import TrainConfig
from d9d.cli._train_step import _optimizer, make_train_step
from d9d.models import Llama, LlamaConfig

GROUPS = 2


def _windows(corpus: np.ndarray, starts: np.ndarray, seq_len: int) -> dict:
    rows = np.stack([corpus[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    tokens = torch.from_numpy(rows)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def _data(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """The global training batches (the first 90% of the corpus) and held-out ones (the rest)."""
    corpus = d9d.data.stdlib_corpus(max_bytes=args.corpus_bytes)
    split = len(corpus) * 9 // 10
    rng = np.random.default_rng(0)
    rows = args.batch_size * GROUPS
    train = [
        _windows(corpus, rng.integers(0, split - args.seq_len - 1, rows), args.seq_len)
        for _ in range(args.steps)
    ]
    held_out = [
        _windows(corpus, rng.integers(split, len(corpus) - args.seq_len - 1, rows), args.seq_len)
        for _ in range(args.eval_batches)
    ]
    return train, held_out


def _model() -> d9d.Model:
    torch.manual_seed(0)
    return d9d.functionalize(Llama(LlamaConfig.tiny()))


def _inner(args: argparse.Namespace) -> d9d.optim.GradientTransformation:
    """``d9d train``'s optimizer for this run's steps and learning rate."""
    return _optimizer(TrainConfig(steps=args.steps, lr=args.lr))


def _half(batch: dict, group: int) -> dict:
    return {k: v.chunk(GROUPS)[group] for k, v in batch.items()}


def _eval_loss(model: d9d.Model, params: dict, held_out: list[dict]) -> float:
    with torch.no_grad():
        losses = [
            d9d.losses.cross_entropy(model.apply(params, b["tokens"]), b["labels"])
            for b in held_out
        ]
    return torch.stack(losses).mean().item()


def _synchronous(args: argparse.Namespace) -> dict:
    train, held_out = _data(args)
    model, opt = _model(), _inner(args)
    step = make_train_step(model, opt)
    params, state = dict(model.params), opt.init(model.params)
    losses = []
    for batch in train:
        params, state, metrics = step(params, state, batch)
        losses.append(metrics["loss"].item())
    return {"train_loss": losses, "eval_loss": _eval_loss(model, params, held_out)}


def _group(args: argparse.Namespace) -> None:
    """One replica group: train under diloco, then write its losses and eval loss."""
    from torchft import Manager, ProcessGroupGloo

    train, held_out = _data(args)
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=120)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=False,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"group{args.group}",
        hostname="localhost",
        init_sync=False,
        timeout=timedelta(seconds=120),
        quorum_timeout=timedelta(seconds=300),
    )
    model, opt = _model(), _inner(args)
    params, state = dict(model.params), opt.init(model.params)
    synchronous = make_train_step(model, opt)
    for batch in train[: args.sync_steps]:  # the same in every group, as in _synchronous
        params, state, _ = synchronous(params, state, batch)
    mesh = d9d.make_mesh("cpu", fsdp=1)
    inner = d9d.shard_params(mesh, "fsdp")(make_train_step(model, opt))
    lr, momentum = _outer(args.outer[0])
    outer = d9d.optim.sgd(lr, momentum=momentum, nesterov=momentum > 0)
    step = d9d.diloco(
        manager, inner_steps=args.inner_steps, outer=outer, warmup_steps=args.warmup_steps
    )(inner)
    params, state = step.place(params, state, model=model)
    print("ready", flush=True)
    sys.stdin.readline()
    losses = []
    for batch in train[args.sync_steps :]:
        params, state, metrics = step(params, state, _half(batch, args.group))
        losses.append(metrics["loss"].item())
    whole = {k: v.full_tensor() for k, v in params.items()}
    result = {
        "train_loss": losses,
        "eval_loss": _eval_loss(model, whole, held_out),
        "rounds_committed": manager.current_step(),
    }
    Path(args.result).write_text(json.dumps(result))
    manager.shutdown(wait=False)


def _outer(text: str) -> tuple[float, float]:
    lr, momentum = text.split(":")
    return float(lr), float(momentum)


def _diloco(args: argparse.Namespace, outer: str) -> list[dict]:
    """Both groups' results of one run with the outer optimizer ``outer`` (``LR:MOMENTUM``)."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000)
    try:
        with tempfile.TemporaryDirectory() as folder:
            procs, results = [], [Path(folder) / f"group{g}.json" for g in range(GROUPS)]
            for group in range(GROUPS):
                command = [
                    *(sys.executable, __file__, *_options(args), f"--outer={outer}"),
                    f"--lighthouse={lighthouse.address()}",
                    f"--group={group}",
                    f"--result={results[group]}",
                ]
                # torchft's log lines into a file: a pipe nobody reads would fill and stop it.
                log = open(Path(folder) / f"group{group}.log", "w")  # noqa: SIM115
                procs.append(
                    subprocess.Popen(
                        command,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                    )
                )
            for proc in procs:
                line = proc.stdout.readline().strip()
                if line != "ready":
                    raise SystemExit(f"a replica group said {line!r} (rc={proc.poll()})")
            for proc in procs:
                proc.stdin.write("go\n")
                proc.stdin.close()
            for group, proc in enumerate(procs):
                if proc.wait() != 0:
                    tail = (Path(folder) / f"group{group}.log").read_text()[-3000:]
                    raise SystemExit(
                        f"replica group {group} failed (rc={proc.returncode}):\n{tail}"
                    )
            return [json.loads(r.read_text()) for r in results]
    finally:
        lighthouse.shutdown()


KEYS = (
    "steps",
    "sync_steps",
    "warmup_steps",
    "inner_steps",
    "batch_size",
    "seq_len",
    "lr",
    "corpus_bytes",
    "eval_batches",
)


def _options(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in KEYS]


def _tail_mean(losses: list[float], n: int = 10) -> float:
    return sum(losses[-n:]) / len(losses[-n:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--sync-steps", type=int, default=0, help="synchronous steps before DiLoCo starts"
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=0, help="diloco's warm-up: averaging rounds each step"
    )
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per group and step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak, as d9d train's --lr")
    parser.add_argument(
        "--outer", nargs="+", default=["0.7:0.9", "1:0"], help="LR:MOMENTUM of each outer SGD"
    )
    parser.add_argument("--corpus-bytes", type=int, default=4 * 2**20)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/diloco-cpu.json"))
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.group is not None:
        _group(args)
        return
    sync = _synchronous(args)
    runs = {}
    for outer in args.outer:
        started = time.perf_counter()
        groups = _diloco(args, outer)
        runs[outer] = {
            "eval_loss": groups[0]["eval_loss"],
            "eval_gap": groups[0]["eval_loss"] / sync["eval_loss"] - 1,
            "groups_equal": len({g["eval_loss"] for g in groups}) == 1,
            "rounds_committed": [g["rounds_committed"] for g in groups],
            "train_loss_last10": [_tail_mean(g["train_loss"]) for g in groups],
            "wall_s": round(time.perf_counter() - started, 1),
            "train_loss": [g["train_loss"] for g in groups],
        }
        print(outer, {k: v for k, v in runs[outer].items() if k != "train_loss"}, flush=True)
    public = argparse.Namespace(**{k: getattr(args, k) for k in (*KEYS, "outer", "out")})
    public.outer = " ".join(args.outer)
    report: dict[str, Any] = {
        **provenance("diloco", public, "cpu", torchft=version("torchft")),
        "synchronous": {
            "eval_loss": sync["eval_loss"],
            "train_loss_last10": _tail_mean(sync["train_loss"]),
            "train_loss": sync["train_loss"],
        },
        "diloco": runs,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
