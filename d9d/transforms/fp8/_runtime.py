"""``fp8`` at run time: each chosen linear's call becomes :func:`fp8_linear` on the tensors
its module holds for this call, and each chosen ``d9d.moe`` experts module computes its
grouped GEMMs with :func:`fp8_grouped_gemm_experts` (set as its ``gemm`` for the call).
Under ``expert_parallel``, which sets each MoE layer's ``dispatch`` to send the tokens to the
ranks of their experts, the experts compute on the rank's experts and the rows dispatched to
them.

The interception sits around the ``nn.Linear`` itself, inside every interception of the
layout transforms (``fp8`` applies in the ``COMPUTE_FORM`` phase, after them): under
``tensor_parallel`` the linear computes on its weight shard and input as that transform
prepared them, and a row-parallel bias that transform set aside for after its reduction is
not the module's during the call. The weight and bias are read off the module when it is
called: the tensors the core swapped into its slots for this call (gathered under
``shard_params``; a weight all-gathered in fp8 is an ``Fp8Weight``, or under ``d9d.jit``
the gather codec's ``(weight, data, scale)``, which ``fp8_linear`` takes as it is).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from ...core._runtime import ApplyCall, Interception, Runtime
from ._experts import fp8_grouped_gemm_experts
from ._linear import fp8_linear

__all__ = ["Fp8Runtime"]


class Fp8Runtime(Runtime):
    """The runtime of ``fp8``: intercepts the linears at ``paths`` and sets the grouped GEMM
    of the experts modules at ``experts``, computing in ``recipe``."""

    def __init__(self, paths: tuple[str, ...], recipe: str, experts: tuple[str, ...] = ()) -> None:
        self.paths = paths
        self.recipe = recipe
        self.experts = experts

    def enter_apply(self, call: ApplyCall) -> None:
        modules = call.structure.modules
        for path in self.paths:
            if not call.stood_in(path):
                around = functools.partial(_linear, modules[path], self.recipe)
                call.intercept(path, Interception(around=around))
        gemm = functools.partial(fp8_grouped_gemm_experts, recipe=self.recipe)
        for path in self.experts:
            if not call.stood_in(path):
                call.override(modules[path], "gemm", gemm)


def _linear(
    module: nn.Linear, recipe: str, forward: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    # nn.Linear.forward(input): by position or by name.
    del forward
    (x,) = (*args, *kwargs.values())
    return fp8_linear(x, module.weight, module.bias, recipe)
