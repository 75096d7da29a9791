"""``fp8``: the matched linears compute their output, input grad and weight grad in fp8."""

from ._linear import fp8_linear as fp8_linear
from ._runtime import Fp8Runtime as Fp8Runtime
from ._select import Choice as Choice
from ._transform import Fp8 as Fp8
from ._transform import fp8 as fp8

__all__ = ["Choice", "Fp8", "Fp8Runtime", "fp8", "fp8_linear"]
