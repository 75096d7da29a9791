"""``remat``: activation checkpointing of the model's blocks; full, selective, every k-th."""

from ._policies import POLICIES as POLICIES
from ._policies import SAVED_OPS as SAVED_OPS
from ._runtime import RematRuntime as RematRuntime
from ._transform import Remat as Remat
from ._transform import remat as remat

__all__ = ["POLICIES", "SAVED_OPS", "Remat", "RematRuntime", "remat"]
