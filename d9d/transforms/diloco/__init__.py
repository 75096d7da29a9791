"""``diloco``: replica groups on torchft that train apart and meet every H steps (DiLoCo)."""

from ._state import DiLoCoState as DiLoCoState
from ._step import DiLoCoStep as DiLoCoStep
from ._transform import DiLoCo as DiLoCo
from ._transform import diloco as diloco

__all__ = ["DiLoCo", "DiLoCoState", "DiLoCoStep", "diloco"]
