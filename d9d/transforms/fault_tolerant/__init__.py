"""``fault_tolerant``: replica groups that train on while one of them fails, on torchft."""

from ._runtime import FaultTolerantRuntime as FaultTolerantRuntime
from ._transform import FaultTolerant as FaultTolerant
from ._transform import fault_tolerant as fault_tolerant

__all__ = ["FaultTolerant", "FaultTolerantRuntime", "fault_tolerant"]
