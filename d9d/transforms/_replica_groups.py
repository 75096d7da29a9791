"""What ``fault_tolerant`` and ``diloco`` share over torchft's replica groups: tensors
all-reduced through the ``Manager`` in buckets of one dtype, sums over each group's tokens
turned into the token mean of every live group, and the one log line a rank writes when the
number of live groups changes."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed import ReduceOp

__all__ = [
    "BUCKET_BYTES",
    "GroupCount",
    "all_reduce_over_groups",
    "async_quorum_refusal",
    "token_mean_over_groups",
    "tokens_like",
]


BUCKET_BYTES = 25 * 2**20
"""The most bytes one all-reduce over the groups carries (as DDP's ``bucket_cap_mb``): the
flat copy each bucket makes is extra memory while it travels."""


def async_quorum_refusal(manager: Any, transform: str) -> str | None:
    """Why ``transform`` cannot take ``manager``, or None: one built with
    ``use_async_quorum=True`` (torchft's default) ends its quorum, and a rejoining group's
    load of its peer's state, only at the commit vote, after the group computed on its own
    stale params (two ``fault_tolerant`` groups on a real lighthouse ended 0.0198 apart, their
    AdamW counts 3 and 4)."""
    if not getattr(manager, "_use_async_quorum", False):
        return None
    return (
        f"{transform} needs a torchft.Manager built with use_async_quorum=False, got one with "
        "use_async_quorum=True (torchft's default): a replica group that rejoins would take a "
        "live peer's state only at the commit vote, after it computed on its own stale "
        "params, and go on one step behind the live groups; pass use_async_quorum=False to "
        "Manager"
    )


def all_reduce_over_groups(
    manager: Any, tensors: list[torch.Tensor], op: ReduceOp, bucket_bytes: int = BUCKET_BYTES
) -> list[torch.Tensor]:
    """``tensors`` all-reduced over the live replica groups by ``op`` (``AVG`` divides by
    their number): ``manager.allreduce`` of flat buckets of one dtype, each of consecutive
    tensors of at most ``bucket_bytes`` (a larger tensor alone). After a failed all-reduce
    the values are garbage, and the manager's ``should_commit`` then says no."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        buckets: list[list[int]] = [[]]
        size = 0
        for i, t in enumerate(tensors):
            if t.dtype != dtype:
                continue
            nbytes = t.numel() * t.element_size()
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += nbytes
        for which in buckets:
            flat = torch.cat([tensors[i].reshape(-1) for i in which])
            manager.allreduce(flat, reduce_op=op).wait()
            pieces = flat.split([tensors[i].numel() for i in which])
            for i, piece in zip(which, pieces, strict=True):
                out[i] = piece.view(tensors[i].shape)
    return [t for t in out if t is not None]


def token_mean_over_groups(
    manager: Any, sums: list[torch.Tensor], tokens: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(means, total)``: each of ``sums`` (this group's sum over its ``tokens`` valid
    tokens) summed over the live groups and divided by ``total``, their tokens in all: the
    weighing of synchronous data parallelism. The count travels with ``sums[0]``, in its
    dtype or float32 where wider (a bfloat16 count rounds above 256). A step or round in
    which no group counted a token gives zeros, as the token mean of no token is 0."""
    count = tokens_like(tokens, sums[0]).reshape(1)
    reduced = all_reduce_over_groups(manager, [*sums, count], ReduceOp.SUM)
    # A 0-d total keeps each sum's dtype, and divides at its full precision.
    total = reduced[-1].reshape(()).clamp(min=1)
    return [r / total for r in reduced[:-1]], total


def tokens_like(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tokens`` (a count) in ``like``'s floating dtype, or float32 where that is wider (a
    bfloat16 count rounds above 256), on ``like``'s device."""
    return tokens.to(device=like.device, dtype=torch.promote_types(like.dtype, torch.float32))


class GroupCount:
    """Logs one line to ``log`` when the number of live replica groups changes (not at the
    first count): ``"<name>: 1 replica group(s) left; <what> continue on 1"``."""

    def __init__(self, log: logging.Logger, name: str, what: str) -> None:
        self.log, self.name, self.what = log, name, what
        self.participants: int | None = None

    def update(self, manager: Any) -> None:
        """Count the groups of ``manager``'s current quorum."""
        now = int(manager.num_participants())
        if self.participants is not None and now != self.participants:
            verb = "left" if now < self.participants else "joined"
            self.log.warning(
                "%s: %d replica group(s) %s; %s continue on %d",
                self.name,
                abs(now - self.participants),
                verb,
                self.what,
                now,
            )
        self.participants = now
