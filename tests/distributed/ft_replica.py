"""One replica group of one rank for tests/distributed/test_fault_tolerant.py, run as its own
process: a torchft Manager on the test's lighthouse, the tiny Llama in float64 under
``shard_params(fsdp=1)`` and ``fault_tolerant``, AdamW.

It talks to the test on stdin/stdout, one line each way, so that every ordering the test
relies on is an event and not a delay: it prints ``ready`` once its manager heartbeats and
waits for ``go``; with ``--pause-after K,L,...`` it prints ``paused`` after committing each
of those steps and waits for ``go`` again; with ``--die-after K`` it SIGKILLs itself after
committing step K; with ``--wait-at K,L,...`` it asks for quorums before each of those steps
until one holds two groups (the lighthouse forms a quorum of the groups that were in the last
one at once, without waiting for a group that asks for the first time); ``--axis dp`` names
its mesh axis ``dp`` instead of ``fsdp`` (another layout). Each attempted step goes to
``--out`` as a JSON line; the final params and optimizer state are saved beside it.

With ``--pp 2`` the group is two ranks (forked processes, each with its own Manager of the
group) of the tiny Llama of two blocks under ``pipeline(pp=2, microbatches=2)``; each rank
saves its stage's params (``.rank{r}.params.pt``). Forked ranks have no stdin: there the
test talks to none, and the groups meet through ``--wait-at 0``.

It starts each step's quorum itself, before it picks the step's batch: a group started
behind the others (a restart) rejoins at that quorum, where its step count jumps to the
live groups', and then reads the batch of that step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from datetime import timedelta

import torch
from equivalence import llama, optimizer, train_step
from torchft import Manager, ProcessGroupGloo

import d9d
from d9d.testing import run_on_ranks

VOCAB = 128


def batch_of(group: int, step: int) -> dict:
    """Replica group ``group``'s batch at ``step``: 2 rows of 16 tokens, each row's labels
    ignored up to a prompt length that differs per group and step (uneven token counts)."""
    g = torch.Generator().manual_seed(1000 * step + group)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=g)
    labels = tokens[:, 1:].clone()
    prompts = torch.randint(0, 12, (2,), generator=g)
    for row, prompt in enumerate(prompts.tolist()):
        labels[row, :prompt] = -100
    return {"tokens": tokens[:, :-1], "labels": labels}


def _wait_for_go() -> None:
    print("ready" if not _wait_for_go.called else "paused", flush=True)
    _wait_for_go.called = True
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("the test closed stdin")


_wait_for_go.called = False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--pause-after", default="")
    parser.add_argument("--die-after", type=int, default=-1)
    parser.add_argument("--wait-at", default="")
    parser.add_argument("--axis", default="fsdp")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.pp == 1:
        store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        _train(args, store.port, rank=0, world=1)
        return
    if args.pause_after:
        raise SystemExit("--pause-after talks on stdin, which the forked ranks of --pp lack")
    run_on_ranks(_pipeline_rank, args.pp, args, method="fork", timeout=240)


def _pipeline_rank(args: argparse.Namespace) -> None:
    rank = torch.distributed.get_rank()
    store = None
    if rank == 0:  # the group's store, which its managers meet through
        store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    port = [store.port if store is not None else None]
    torch.distributed.broadcast_object_list(port, src=0)
    _train(args, port[0], rank=rank, world=args.pp)


def _train(args: argparse.Namespace, port: int, *, rank: int, world: int) -> None:
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=None,  # fault_tolerant registers the params and optimizer state
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=False,
        rank=rank,
        world_size=world,
        store_addr="localhost",
        store_port=port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"group{args.group}",
        hostname="localhost",
        init_sync=False,  # every group starts from the same seeded params
        timeout=timedelta(seconds=60),
        quorum_timeout=timedelta(seconds=120),
    )
    mesh = d9d.make_mesh("cpu", **({args.axis: 1} if args.pp == 1 else {"pp": args.pp}))
    torch.manual_seed(0)
    model = llama(torch.float64, n_layers=1 if args.pp == 1 else 2)()
    opt = optimizer("adamw")
    ft = d9d.fault_tolerant(manager, starts_quorum=False)
    if args.pp == 1:
        step = ft(d9d.shard_params(mesh, args.axis)(train_step(model, opt)))
    else:
        step = ft(d9d.pipeline(mesh, microbatches=2)(train_step(model, opt)))
    pauses = {int(k) for k in args.pause_after.split(",") if k}
    waits = {int(k) for k in args.wait_at.split(",") if k}
    params, state = step.place(model.params, opt.init(model.params), model=model)
    if world == 1:
        _wait_for_go()
    with open(args.out if rank == 0 else os.devnull, "w") as log:
        while manager.current_step() < args.steps:
            manager.start_quorum()  # a restarted group rejoins here: its step jumps
            while manager.current_step() in waits and manager.num_participants() < 2:
                manager.start_quorum()  # no other group takes part in these: no step runs
            waits.discard(manager.current_step())  # two groups: wait only this once
            at = manager.current_step()
            params, state, metrics = step(params, state, batch_of(args.group, at))
            committed = manager.current_step() == at + 1
            line = {"step": at, "committed": committed, "loss": metrics["loss"].item()}
            log.write(json.dumps({**line, "participants": manager.num_participants()}) + "\n")
            log.flush()
            if committed and at == args.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if committed and at in pauses:
                _wait_for_go()
    saved = args.out if world == 1 else f"{args.out}.rank{rank}"
    torch.save({k: v.full_tensor() for k, v in params.items()}, saved + ".params.pt")
    leaves = d9d.tree.leaves(state)
    kept = [x.full_tensor() if hasattr(x, "full_tensor") else x for x in leaves]
    torch.save([x for x in kept if torch.is_tensor(x)], saved + ".opt_state.pt")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
