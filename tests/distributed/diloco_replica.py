"""One replica group of one rank for tests/distributed/test_diloco.py, run as its own process:
a torchft Manager on the test's lighthouse, the tiny Llama in float64 under
``shard_params(fsdp=1)`` and ``diloco``, inner SGD with momentum and weight decay.

It talks to the test as ``ft_replica.py`` does: ``ready`` once its manager heartbeats, then it
waits for ``go``. With ``--die-in-round K`` it SIGKILLs itself inside outer round K, once the
round's quorum holds it (so the others' all-reduce meets a dead peer). Each step goes to
``--out`` as a JSON line; the manager's all-reduces (counted here, outside d9d) and the final
params are saved beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
from equivalence import llama, train_step
from torchft import Manager, ProcessGroupGloo

import d9d

VOCAB = 128
INNER_LR = 0.1


def inner_optimizer() -> d9d.optim.GradientTransformation:
    """Linear in the grads (no clipping), so that averaging after one step is data parallelism."""
    return d9d.optim.sgd(INNER_LR, momentum=0.9, weight_decay=0.1)


def batch_of(group: int, step: int, ignored: int = 0) -> dict:
    """Replica group ``group``'s batch at ``step``: 2 rows of 16 tokens, every label counted
    but, in group 1's rows, the first ``ignored`` (-100): the groups then train on uneven
    token counts, each the same share of the tokens at every step."""
    g = torch.Generator().manual_seed(1000 * step + group)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=g)
    labels = tokens[:, 1:].clone()
    if group == 1:
        labels[:, :ignored] = -100
    return {"tokens": tokens[:, :-1], "labels": labels}


class CountingManager:
    """The manager, its ``allreduce`` calls and elements counted; SIGKILL inside a round."""

    def __init__(self, manager: Manager, die_in_round: int) -> None:
        self.manager = manager
        self.die_in_round = die_in_round
        self.rounds = 0
        self.participants: list[int] = []  # per round, once its quorum holds
        self.allreduces = 0
        self.elements = 0

    def start_quorum(self) -> None:
        self.manager.start_quorum()
        if self.rounds == self.die_in_round:
            os.kill(os.getpid(), signal.SIGKILL)
        self.rounds += 1
        self.participants.append(self.manager.num_participants())

    def allreduce(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        self.allreduces += 1
        self.elements += tensor.numel()
        return self.manager.allreduce(tensor, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--inner-steps", type=int, required=True)
    parser.add_argument("--outer", choices=("sgd1", "nesterov"), required=True)
    parser.add_argument("--die-in-round", type=int, default=-1)
    parser.add_argument("--die-at-step", type=int, default=-1)
    parser.add_argument("--join", action="store_true")
    parser.add_argument("--ignored", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    real = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
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
        init_sync=False,  # every group starts from the same seeded params
        timeout=timedelta(seconds=60),
        quorum_timeout=timedelta(seconds=120),
    )
    manager = CountingManager(real, args.die_in_round)
    outer = d9d.optim.sgd(1.0) if args.outer == "sgd1" else None  # None: the default Nesterov
    mesh = d9d.make_mesh("cpu", fsdp=1)
    torch.manual_seed(0)
    model, opt = llama(torch.float64, n_layers=1)(), inner_optimizer()
    inner = d9d.shard_params(mesh, "fsdp")(train_step(model, opt))
    step = d9d.diloco(
        manager, inner_steps=args.inner_steps, outer=outer, warmup_steps=args.warmup_steps
    )(inner)
    params, state = step.place(model.params, opt.init(model.params), model=model)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("the test closed stdin")
    if args.join:
        manager.start_quorum()  # waits for the live groups' next outer round
        params, state = step.join(params, state)
    with open(args.out, "w") as log:
        while (at := int(state.inner_step)) < args.steps:
            if at == args.die_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            params, state, metrics = step(params, state, batch_of(args.group, at, args.ignored))
            line = {"step": at, "loss": metrics["loss"].item(), "rounds": real.current_step()}
            log.write(json.dumps(line) + "\n")
            log.flush()
    counts = {
        "allreduces": manager.allreduces,
        "elements": manager.elements,
        "participants": manager.participants,
    }
    with open(args.out + ".counts.json", "w") as f:
        json.dump(counts, f)
    torch.save({k: v.full_tensor() for k, v in params.items()}, args.out + ".params.pt")
    real.shutdown(wait=False)


if __name__ == "__main__":
    main()
