"""``d9d train --fault-tolerant``: this job as one torchft replica group.

The group's ranks (one ``torchrun``, or one process) each build a torchft ``Manager`` on the
group's store (torchrun's, or one this process serves) and the lighthouse; the step is wrapped
in :func:`d9d.fault_tolerant`, and the group reads its share of every global batch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ConfigError
from ...transforms.diloco import diloco
from ...transforms.fault_tolerant import fault_tolerant
from .._config import TrainConfig

__all__ = ["ReplicaGroup", "join_replica_group"]


@dataclass(frozen=True)
class ReplicaGroup:
    """This rank's part of a replica group.

    Attributes:
        manager: Its torchft ``Manager``.
        store: The group's store, when this process serves it (no torchrun), else None.
        diloco: Inner steps per DiLoCo outer round; None: grads averaged every step.
    """

    manager: Any
    store: Any = None
    diloco: int | None = None

    def wrap(self, step: Callable[..., Any]) -> Any:
        """``step`` as a step of this group: fault-tolerant, or DiLoCo's inner step."""
        if self.diloco is not None:
            return diloco(self.manager, inner_steps=self.diloco)(step)
        return fault_tolerant(self.manager)(step)

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
    if dist.is_initialized():  # under torchrun: its store, at MASTER_ADDR:MASTER_PORT
        rank, world = dist.get_rank(), dist.get_world_size()
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    else:
        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        rank, world, address, port = 0, 1, "localhost", store.port
    group = ProcessGroupNCCL(timeout) if torch.cuda.is_available() else ProcessGroupGloo(timeout)
    manager = Manager(
        pg=group,
        load_state_dict=_refuse_rejoin,
        state_dict=dict,  # what a peer serves a group that asks to rejoin: nothing yet
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
    _wait_for_every_group(manager, config.replica_groups or 1, config.dist_timeout)
    return ReplicaGroup(manager, store, config.diloco)


def _wait_for_every_group(manager: Any, groups: int, timeout_s: float) -> None:
    """Ask the lighthouse for quorums until one holds all ``groups``, so that no group
    trains ahead while another is still starting: a group behind the others would have to
    rejoin, which is not built. Each ask is one round trip to the lighthouse, which answers
    once a quorum forms (a group still starting, heartbeating or not, holds none up for
    long: the lighthouse then answers with the groups that asked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        manager.start_quorum()
        joined = manager.num_participants()
        if joined >= groups:
            return
        if time.monotonic() > deadline:
            raise ConfigError(
                f"only {joined} of --replica-groups {groups} replica groups reached the "
                f"lighthouse within --dist-timeout {timeout_s:g} s; start them all"
            )
        time.sleep(0.1)  # a lone group's quorum comes back at once: ask ten times a second


def _refuse_rejoin(state: object) -> None:
    """torchft asks a group that joins behind the others to load their live state."""
    del state
    raise ConfigError(
        "this replica group joined while the others were past step 0, and rejoining (the "
        "live params and optimizer state copied from a peer) is not built yet (issue 30); "
        "start every replica group together, and restart them all after a failure"
    )
