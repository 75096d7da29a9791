"""Forward prefetch: the next block's all-gather issued before the current block computes.

[Note: prefetch]
Without prefetch a block's all-gather starts when the block starts and the block waits for it:
communication and compute take turns. With it, when block ``i`` starts, its own all-gather
(issued while block ``i - 1`` ran) is waited for and block ``i + 1``'s is issued at once, so
it runs while block ``i`` computes, as FSDP2 prefetches. The params outside blocks are gathered
when ``apply`` starts and issue block 0's. Every rank runs the same blocks in the same order,
so every rank issues the same collectives in the same order. At most one gather is issued
ahead: the gathered params alive at once are the root's, the running block's and the next
block's. A block that runs out of order gathers for itself; one issued for a block that never
runs is waited for and dropped when ``apply`` ends. After that (a block recomputed in the
backward by ``remat``) blocks gather for themselves. The backward's prefetch (the block
before, in forward order) is ``Regather``'s. Eager only: under ``torch.compile`` the
collectives are in the graph and the compiler schedules them.

A block whose forward another runtime's interception runs ``around`` may run it again (a
checkpoint recomputes it in the backward). Such a block gathers for itself and issues no
gather for the next one, so that its forward and its recomputation run the same
collectives: a selective checkpoint replays the forward's ops in order and fails on any op
the forward did not run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.tensor import DTensor

from ...core._gather import IssuedGather, issue_gather
from ...core._plan import Plan
from ...core._structure import Block

__all__ = ["ForwardPrefetch", "prefetches"]


def prefetches(
    plan: Plan, keys: list[str], params: Mapping[str, Any], early: frozenset[str]
) -> bool:
    """Whether the gather of ``keys`` may be issued ahead: every param among them that is
    gathered (a stored DTensor) is in ``early`` (its schedule says ``prefetch``), and there
    is one."""
    gathered = [
        k
        for k in keys
        if isinstance(params[k], DTensor) and plan.entries[k].compute != plan.entries[k].storage
    ]
    return bool(gathered) and all(k in early for k in gathered)


class ForwardPrefetch:
    """Issues, during one ``Model.apply``'s forward, each block's all-gather one block early."""

    def __init__(
        self,
        plan: Plan,
        params: Mapping[str, Any],
        units: list[tuple[Block, list[str]]],
        rerun: set[str],
        early: frozenset[str],
    ) -> None:
        """``units``: the blocks this call gathers, in the order they run, with the (unique)
        param paths each gathers; ``rerun``: paths of those whose forward may run again (a
        runtime's interception runs ``around`` it: a checkpoint); ``early``: paths of the
        params whose schedule says ``prefetch``."""
        self.plan = plan
        self.params = params
        self.units = [
            (b, None if b.path in rerun or not prefetches(plan, keys, params, early) else keys)
            for b, keys in units
        ]
        self.rerun = rerun
        self.index = {block.path: i for i, (block, _) in enumerate(units)}
        self.issued: tuple[str, IssuedGather] | None = None
        self.open = True

    @property
    def active(self) -> bool:
        """Whether some block's gather may be issued ahead."""
        return any(keys is not None for _, keys in self.units)

    def take(self, block: Block) -> IssuedGather | None:
        """The gathers issued for ``block``, if they were (``gather_params(issued=...)``)."""
        if self.issued is None or self.issued[0] != block.path:
            return None
        issued, self.issued = self.issued[1], None
        return issued

    def issue_after(self, block: Block | None) -> None:
        """Issue the gathers of the block after ``block`` (None: the first), unless the
        forward is over, one is already issued, or either block may run again."""
        if not self.open or self.issued is not None:
            return
        if block is not None and block.path in self.rerun:
            return
        following = 0 if block is None else self.index.get(block.path, len(self.units)) + 1
        if following >= len(self.units):
            return
        after, keys = self.units[following]
        if keys is not None:
            self.issued = (after.path, issue_gather(self.plan, keys, self.params))

    def close(self) -> None:
        """End of the forward: wait for and drop a gather no block took; issue no more."""
        self.open = False
        if self.issued is not None:
            self.issued[1].wait()
            self.issued = None
