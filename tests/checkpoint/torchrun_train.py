"""A 2-rank data-parallel tiny Llama run that checkpoints every few steps and resumes.

``test_fault_tolerance.py`` launches it under ``torchrun --max-restarts 1`` with
``--kill-at``: in the first attempt rank 1 SIGKILLs itself, torchrun restarts both ranks,
and they resume from the latest complete checkpoint. With ``--reference-out`` the ranks
then also train from scratch, uninterrupted, into that folder, for the test to compare
(in the same processes, which saves starting two more). A replicated model with grads
all-reduced by hand: this tests checkpoint and restart, not sharding.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from d9d import checkpoint, functionalize, init_process_group, losses, optim, value_and_grad
from d9d.models import Llama, LlamaConfig

CONFIG = LlamaConfig.tiny(n_layers=1, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=48)


def _batch(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, CONFIG.vocab_size, (2, 17), generator=generator)


def run(out: str, steps: int, save_every: int, kill_at: int | None = None) -> dict[str, Any]:
    """Train ``steps`` steps from the latest checkpoint in ``out`` (or from scratch)."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = functionalize(Llama(CONFIG))
    opt = optim.adamw(1e-2)
    params = {k: v.detach().clone() for k, v in model.params.items()}
    opt_state = opt.init(params)
    start = 0
    if (latest := checkpoint.latest(out)) is not None:
        state = checkpoint.restore_train_state(latest, params=params, opt_state=opt_state)
        params, opt_state, start = state.params, state.opt_state, state.step

    def loss_fn(params: Any, tokens: torch.Tensor) -> torch.Tensor:
        return losses.cross_entropy(model.apply(params, tokens[:, :-1]), tokens[:, 1:])

    found, handle = [], None
    for step in range(start, steps):
        if step == kill_at and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            handle.wait()  # the kill lands after a known commit, so the resume point is fixed
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        loss, grads = value_and_grad(loss_fn)(params, _batch(step, rank))
        for grad in grads.values():
            dist.all_reduce(grad)
            grad.div_(world)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optim.apply_updates(params, updates)
        dist.all_reduce(loss)
        found.append(loss.item() / world)
        if (step + 1) % save_every == 0:
            if handle is not None:
                handle.wait()
            handle = checkpoint.save_train_state(
                out, step=step + 1, params=params, opt_state=opt_state, keep=2
            )
    if handle is not None:
        handle.wait()
    return {"start": start, "losses": found}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--reference-out", default=None)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    init_process_group("gloo")
    result = run(args.out, args.steps, args.save_every, args.kill_at)
    if args.reference_out:
        result["reference"] = run(args.reference_out, args.steps, args.save_every)["losses"]
    if dist.get_rank() == 0:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        Path(args.result).write_text(json.dumps({**result, "attempt": attempt}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
