"""The phases in which transforms apply: the one place where their order is decided.

A transform declares its :class:`Phase`; a step applies its transforms phase by phase, and
transforms of one phase (which set different mesh axes, or different fields of a param's
plan) in the order of their names. The user's decorator order never matters. Each phase
reads what the phases before it decided:

1. ``COMPUTE_LAYOUT``: where a param is computed on, its own mesh axis each
   (``tensor_parallel``, ``context_parallel``);
2. ``STORAGE``: how the compute layout is stored, on the dims phase 1 left free
   (``shard_params``: sharded over ``fsdp``, gathered for compute);
3. ``STAGES``: the whole plan laid out on a stage's mesh; its stage input replaces what the
   block interceptions of phases 1 and 2 prepared (``pipeline``);
4. ``COMPUTE_FORM``: what a stored shard becomes when it is gathered and computed with, and
   what comes back to it (a gather codec, a grad scale, the optimizer state's placement and
   device): it reads the final storage (``fp8`` belongs here; ``shard_params``' own
   ZeRO-1/2 placements are set by its phase-2 rule);
5. ``RECOMPUTATION``: blocks run again as all the others run them (``remat``).

A new transform picks its phase; no other transform's file changes.
"""

from __future__ import annotations

import enum

__all__ = ["Phase"]


class Phase(enum.IntEnum):
    """When a transform applies, relative to the others (lower first)."""

    COMPUTE_LAYOUT = 1
    STORAGE = 2
    STAGES = 3
    COMPUTE_FORM = 4
    RECOMPUTATION = 5
