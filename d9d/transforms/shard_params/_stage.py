"""Which ZeRO stage ``shard_params`` keeps a param in: its annotation, a plan column."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

__all__ = ["ZeroStage"]


@dataclass(frozen=True)
class ZeroStage:
    """``shard_params``' annotation of a param stored whole whose optimizer state (ZeRO-1),
    and grad (ZeRO-2), it shards.

    Attributes:
        stage: 1 or 2.
    """

    column: ClassVar[str] = "zero"  # the plan table's column this annotation fills
    stage: int

    def __post_init__(self) -> None:
        if self.stage not in (1, 2):
            raise ValueError(
                f"ZeroStage(stage={self.stage!r}): a param stored whole is in ZeRO-1 or ZeRO-2; "
                "pass stage=1 or 2 (ZeRO-3 stores the param sharded and needs no annotation)"
            )

    def cell(self) -> str:
        """Its cell in the plan's table: ``ZeRO-1`` or ``ZeRO-2``."""
        return f"ZeRO-{self.stage}"
