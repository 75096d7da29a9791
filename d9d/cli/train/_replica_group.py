"""``d9d train --fault-tolerant``: this job as one torchft replica group.

The group's ranks (one ``torchrun``, or one process) each build a torchft ``Manager`` on the
group's store (torchrun's, or one this process serves) and the lighthouse; the step is wrapped
in :func:`d9d.fault_tolerant` (or, with ``--diloco H``, :func:`d9d.diloco`, whose outer
rounds start their own quorums), and the group reads its share of every global batch.

The loop starts each step's quorum itself (:meth:`ReplicaGroup.start_step`), before it reads
the step's batch: a group restarted behind the others rejoins there, taking a live peer's
params and optimizer state (the transform's part) and data loader position (this module's
part, beside them in torchft's state dict), and its step count jumps to the peer's. Under
DiLoCo the quorum a restarted group heals at is the live groups' outer round: it runs that
round with the peer's state at once (:meth:`ReplicaGroup.join`), and the data position
served is the one after the peer's step.

With ``--resume``, each group first restores its own newest checkpoint and sets its
manager's step to the checkpoint's (:meth:`ReplicaGroup.resume_at`); at the first quorum,
which waits for every group, the groups behind the one furthest ahead heal from it the same
way, so all of them go on from one step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ConfigError
from ...launch._exit import wait_at_exit_for_collective_threads
from ...transforms.diloco import DiLoCoStep, diloco
from ...transforms.fault_tolerant import FaultTolerantRuntime, fault_tolerant
from .._config import TrainConfig
from .._precision import replica_microbatches

__all__ = ["ReplicaGroup", "join_replica_group"]

_log = logging.getLogger("d9d.fault_tolerant")


DATA_KEY = "d9d.train.data"
"""The key of the data loader's position in torchft's state dict of a replica group."""


class ReplicaGroup:
    """This rank's part of a replica group.

    Attributes:
        manager: Its torchft ``Manager``.
        store: The group's store, when this process serves it (no torchrun), else None.
        groups: How many replica groups the job starts (``--replica-groups``).
        timeout_s: How long the first step waits for all of them (``--dist-timeout``).
        diloco: Inner steps per DiLoCo outer round (``--diloco``); None: grads averaged
            every step.
        microbatches: ``--grad-accum`` microbatches per step, accumulated by
            ``d9d.fault_tolerant`` (1 under DiLoCo, whose inner step accumulates them).
        diloco_warmup: DiLoCo's first steps each followed by an averaging round
            (``--diloco-warmup``).
    """

    def __init__(
        self,
        manager: Any,
        store: Any,
        groups: int,
        timeout_s: float,
        diloco: int | None = None,
        microbatches: int = 1,
        diloco_warmup: int = 0,
    ) -> None:
        self.manager = manager
        self.store = store
        self.groups = groups
        self.timeout_s = timeout_s
        self.diloco = diloco
        self.diloco_warmup = diloco_warmup
        self.microbatches = microbatches
        self.loader: Any = None
        self.position: dict[str, int] | None = None  # that of the batch in hand, if one is
        self.rejoined = False
        self.peer_training = False  # the peer this group healed from had begun stepping
        self._started = False
        self._step: Any = None  # the wrapped step

    def wrap(self, step: Callable[..., Any]) -> Any:
        """``step`` as a step of this group: fault-tolerant (whose quorum this starts), or
        DiLoCo's inner step (whose outer rounds start their own)."""
        if self.diloco is not None:
            self._step = diloco(
                self.manager, inner_steps=self.diloco, warmup_steps=self.diloco_warmup
            )(step)
        else:
            self._step = fault_tolerant(
                self.manager, starts_quorum=False, microbatches=self.microbatches
            )(step)
        return self._step

    def resume_at(self, step: int, params: Any, opt_state: Any, metadata: Any) -> None:
        """Go on from a restored checkpoint of ``step`` steps: the manager's step count (and
        its ``state_dict()`` saved in the checkpoint's ``metadata["torchft"]``, if there)
        and, for a group behind that heals from this one at the first quorum, the params and
        optimizer state served to it."""
        saved = metadata.get("torchft") if isinstance(metadata, dict) else None
        saved = saved if isinstance(saved, dict) else {}
        state = {
            "step": self._count_at(step, saved),
            "batches_committed": int(saved.get("batches_committed", 0)),
        }
        self.manager.load_state_dict(state)
        if isinstance(self._step, DiLoCoStep):
            self._step.serve(params, opt_state)
            return
        for runtime in self._step.runtimes:
            if isinstance(runtime, FaultTolerantRuntime):
                runtime.serve(params, opt_state)

    def _count_at(self, step: int, saved: dict[str, Any]) -> int:
        """The manager's step count at a checkpoint of ``step`` steps: the steps committed,
        or under DiLoCo the outer rounds committed (the checkpoint's own count, ``saved``
        from the manager that saved it; else every round up to ``step``). Not the inner
        steps: torchft heals the groups whose count is behind the quorum's, so a group
        restored at inner step 2 with rounds after every 2 steps, counting 2 among live
        groups at round 2, healed none and hung in the next round's all-reduce, and one
        counting more than them would have been copied back by the live groups."""
        if self.diloco is None:
            return step
        if "step" in saved:
            return int(saved["step"])
        warmup = min(step, self.diloco_warmup)
        return warmup + (step - warmup) // self.diloco

    def join(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """After :meth:`start_step` said this group rejoined: under DiLoCo, the live peer's
        params and state, and the outer round it was in run to its end with them
        (:meth:`DiLoCoStep.join`); without, ``fault_tolerant`` takes them at the step."""
        if isinstance(self._step, DiLoCoStep):
            return self._step.join(params, opt_state)
        return params, opt_state

    def steps_done(self, opt_state: Any) -> int:
        """The steps this group has done: those committed, or under DiLoCo its inner steps
        (the manager counts outer rounds)."""
        if self.diloco is not None:
            return int(opt_state.inner_step)
        return self.commits()

    def follow(self, loader: Any) -> None:
        """Serve ``loader``'s position to a rejoining peer, and take a peer's on a rejoin."""
        self.loader = loader
        self.manager.register_state_dict_fn(DATA_KEY, self._receive, self._serve)

    def _serve(self) -> dict[str, Any]:
        position = self.position if self.position is not None else self.loader.state_dict()
        return {"position": position, "training": self._started}

    def _receive(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["position"])
        self.position = None
        self.rejoined = True
        self.peer_training = bool(state["training"])

    def start_step(self) -> bool:
        """Start the next step's quorum; whether this group rejoined at it (its step count,
        params, optimizer state and data position are then a live peer's). The first waits
        until every group takes part, or this group rejoins groups already training. Under
        DiLoCo only the first: its outer rounds start their own quorums."""
        self.rejoined = False
        if self._started:
            if self.diloco is None:
                self.manager.start_quorum()
        else:
            _wait_for_every_group(
                self.manager,
                self.groups,
                self.timeout_s,
                lambda: self.rejoined and self.peer_training,
            )
            self._started = True
        return self.rejoined

    def commits(self) -> int:
        """Steps committed so far (a step a failure interrupted is not)."""
        return int(self.manager.current_step())

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def join_replica_group(config: TrainConfig) -> ReplicaGroup:
    """This rank's ``Manager`` of replica group ``config.replica_group_id``."""
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

    timeout = timedelta(seconds=config.dist_timeout)
    store = None
    # Under torchrun: its store, at MASTER_ADDR:MASTER_PORT. One process may have a process
    # group of its own (--dtype, --grad-accum under --diloco: a one-rank mesh), and no store.
    if dist.is_initialized() and "MASTER_ADDR" in os.environ:
        rank, world = dist.get_rank(), dist.get_world_size()
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    else:
        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        rank, world, address, port = 0, 1, "localhost", store.port
    group = ProcessGroupNCCL(timeout) if torch.cuda.is_available() else ProcessGroupGloo(timeout)
    wait_at_exit_for_collective_threads()  # a group of one process joins no other gloo group
    manager = Manager(
        pg=group,
        load_state_dict=None,  # fault_tolerant and ReplicaGroup.follow register theirs
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=False,
        rank=rank,
        world_size=world,
        store_addr=address,
        store_port=port,
        lighthouse_addr=config.lighthouse,
        replica_id=f"d9d_group{config.replica_group_id}",
        init_sync=False,  # every group inits from --seed: the same params
        timeout=timeout,
        quorum_timeout=timeout,
    )
    return ReplicaGroup(
        manager,
        store,
        config.replica_groups or 1,
        config.dist_timeout,
        config.diloco,
        replica_microbatches(config),
        config.diloco_warmup,
    )


def _wait_for_every_group(
    manager: Any, groups: int, timeout_s: float, joined_live: Callable[[], bool]
) -> None:
    """Ask the lighthouse for quorums until one holds all ``groups``, or this group rejoined
    groups already training (``joined_live()``: a restart), so that at the start, or at a
    resume of every group, no group trains ahead while another is still starting. A group
    that heals from one still waiting (resumed further ahead) waits on with it. The last
    quorum is the first step's. Each ask is one round
    trip to the lighthouse, which answers once a quorum forms (a group still starting,
    heartbeating or not, holds none up for long: the lighthouse then answers with the
    groups that asked); a quorum only this group takes part in runs no step."""
    deadline = time.monotonic() + timeout_s
    told = False
    while True:
        manager.start_quorum()
        joined = manager.num_participants()
        if joined >= groups or joined_live():
            return
        if not told:
            _log.warning(
                "d9d train: %d of --replica-groups %d replica groups in the quorum; waiting "
                "for the others",
                joined,
                groups,
            )
            told = True
        if time.monotonic() > deadline:
            raise ConfigError(
                f"only {joined} of --replica-groups {groups} replica groups reached the "
                f"lighthouse within --dist-timeout {timeout_s:g} s; start them all"
            )
        time.sleep(0.1)  # a lone group's quorum comes back at once: ask ten times a second
