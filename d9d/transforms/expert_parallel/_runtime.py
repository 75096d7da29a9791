"""Expert parallelism at run time: each MoE layer's ``dispatch(x, expert_ids, weights)``
becomes the registry's ``dispatch``, the local experts, and ``combine``; so does each Hugging
Face experts module's call (``_hf_experts.py``).

The runtime sets the layer's ``token_dispatch`` for one ``Model.apply`` (an override of the
call, restored after it), inside the block whose params the core has already swapped in: the
layer's ``experts`` module (with whatever other transforms set on it, ``d9d.fp8``'s grouped
GEMM) computes with this rank's ``E / ep`` experts, on the rows the ep ranks sent for them,
grouped by local expert.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor
from torch.distributed import ProcessGroup

from ...core._runtime import ApplyCall, Runtime
from ...kernels import DispatchGroup, combine, dispatch, dispatch_layout
from ...moe import MoE
from ._hf_experts import HFExperts, intercept_hf_experts

__all__ = ["ExpertParallelRuntime", "dispatch_and_combine"]


class ExpertParallelRuntime(Runtime):
    """The runtime of ``expert_parallel``: sets the ``token_dispatch`` of the MoE layers at
    ``layers`` and intercepts the Hugging Face experts modules ``hf_experts`` for each call."""

    def __init__(
        self,
        layers: tuple[str, ...],
        group: ProcessGroup,
        hf_experts: tuple[HFExperts, ...] = (),
    ) -> None:
        self.layers = layers
        self.hf_experts = hf_experts
        self.group = DispatchGroup.of(group)  # read here: a trace sees no group object

    def enter_apply(self, call: ApplyCall) -> None:
        for path in self.layers:
            if not call.stood_in(path):
                layer = call.structure.modules[path]
                exchange = functools.partial(dispatch_and_combine, layer, self.group)
                call.override(layer, "token_dispatch", exchange)
        for experts in self.hf_experts:
            intercept_hf_experts(call, experts, self.group)

    def jit_config(self) -> dict[str, Any]:
        # The dispatch reads its split sizes on the host (``.tolist()``): traced, they are
        # unbacked sizes, so one graph serves every routing (docs/decisions.md).
        return {"capture_scalar_outputs": True}


def dispatch_and_combine(
    layer: MoE, group: DispatchGroup, x: Tensor, expert_ids: Tensor, weights: Tensor
) -> Tensor:
    """``layer.dispatch`` over ``group``: ``x [T, dim]`` to the ranks of its experts, through
    the layer's local experts, and back weighted by ``weights [T, k]``."""
    layout = dispatch_layout(expert_ids, layer.config.n_experts, group.size)
    rows, group_sizes, handle = dispatch(x, expert_ids, weights, layout, group)
    return combine(layer.experts(rows, group_sizes), handle)
