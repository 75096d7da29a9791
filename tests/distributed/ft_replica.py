"""One replica group of one rank for tests/distributed/test_fault_tolerant.py, run as its own
process: a torchft Manager on the test's lighthouse, the tiny Llama in float64 under
``shard_params(fsdp=1)`` and ``fault_tolerant``, AdamW.

It talks to the test on stdin/stdout, one line each way, so that every ordering the test
relies on is an event and not a delay: it prints ``ready`` once its manager heartbeats and
waits for ``go``; with ``--pause-after K`` it prints ``paused`` after committing step K and
waits for ``go`` again; with ``--die-after K`` it SIGKILLs itself after committing step K.
Each attempted step goes to ``--out`` as a JSON line; the final params are saved beside it.
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
from d9d.cli.train._replica_group import _refuse_rejoin

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
    parser.add_argument("--pause-after", type=int, default=-1)
    parser.add_argument("--die-after", type=int, default=-1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=_refuse_rejoin,  # as d9d train does: rejoining is not built
        state_dict=dict,
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
    mesh = d9d.make_mesh("cpu", fsdp=1)
    torch.manual_seed(0)
    model, opt = llama(torch.float64, n_layers=1)(), optimizer("adamw")
    step = d9d.fault_tolerant(manager)(d9d.shard_params(mesh, "fsdp")(train_step(model, opt)))
    params, state = step.place(model.params, opt.init(model.params), model=model)
    _wait_for_go()
    with open(args.out, "w") as log:
        while manager.current_step() < args.steps:
            at = manager.current_step()
            params, state, metrics = step(params, state, batch_of(args.group, at))
            committed = manager.current_step() == at + 1
            line = {"step": at, "committed": committed, "loss": metrics["loss"].item()}
            log.write(json.dumps({**line, "participants": manager.num_participants()}) + "\n")
            log.flush()
            if committed and at == args.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if committed and at == args.pause_after:
                _wait_for_go()
    torch.save({k: v.full_tensor() for k, v in params.items()}, args.out + ".params.pt")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
