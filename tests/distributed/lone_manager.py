"""A stand-in for torchft's ``Manager`` of one replica group alone (no lighthouse), recording
the calls that ``fault_tolerant`` and ``diloco`` make."""

from __future__ import annotations

import torch


class LoneManager:
    """A torchft Manager's calls for one replica group alone; ``votes`` are what
    ``should_commit`` answers, call by call (a True advances ``current_step``)."""

    def __init__(self, votes: list[bool] = ()) -> None:
        self.votes = list(votes)
        self.calls: list[str] = []
        self.state_fns: dict[str, tuple] = {}  # key: (load_state_dict, state_dict)
        self.reduced: list[torch.Tensor] = []  # copies of what each allreduce carried
        self.step = 0

    def register_state_dict_fn(self, key: str, load: object, save: object) -> None:
        self.state_fns[key] = (load, save)

    def current_step(self) -> int:
        return self.step

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "batches_committed": 0}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]

    def start_quorum(self) -> None:
        self.calls.append("start_quorum")

    def allreduce(self, tensor: torch.Tensor, reduce_op: object = None) -> LoneManager:
        self.calls.append(f"allreduce {tensor.dtype} {tensor.numel()}")
        self.reduced.append(tensor.clone())
        return self

    def wait(self) -> None:
        pass

    def num_participants(self) -> int:
        return 1

    def should_commit(self) -> bool:
        self.calls.append("should_commit")
        kept = self.votes.pop(0)
        self.step += kept
        return kept
