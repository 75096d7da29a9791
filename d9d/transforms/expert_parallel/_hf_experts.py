"""A Hugging Face experts module under ``expert_parallel``: its call
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` becomes dispatch,
the module's own forward on this rank's ``E / ep`` experts, and combine.

The runtime intercepts the module for one ``Model.apply`` and sets its ``num_experts`` to
``E / ep`` (what ``transformers``' experts implementations read; its stacked params are
already this rank's ``Shard(0)`` slice). The forward runs on the rows dispatched to this rank,
one per choice of a local expert, each with its local expert id and weight 1: activation,
biases, clamping and the experts implementation stay ``transformers``'; combine applies the
routing weights and sums each token's rows, as the module would have.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ...core._runtime import ApplyCall, Interception
from ...hf._experts import interface_experts
from ...kernels import DispatchGroup, combine, dispatch, dispatch_layout

if TYPE_CHECKING:
    from ...core._model import Model

__all__ = ["HFExperts", "hf_expert_params", "intercept_hf_experts"]

HFExperts = tuple[str, int, tuple[str, ...]]
"""An experts module as the runtime keeps it: its path, its expert count ``E`` and the names
of its forward's three parameters."""


def hf_expert_params(model: Model) -> frozenset[str]:
    """The paths of every param of ``model``'s Hugging Face experts modules of
    ``transformers``' interface (``d9d.hf``'s ``interface_experts``): each an ``[E, ...]``
    stack that the module's forward indexes by expert, so each rank holds ``E / ep`` of it,
    a bias as much as a weight."""
    structure = model.structure
    return frozenset(
        structure.canonical(f"{path}.{name}")
        for path in interface_experts(structure.module)
        for name, _ in structure.modules[path].named_parameters()
    )


def intercept_hf_experts(call: ApplyCall, experts: HFExperts, group: DispatchGroup) -> None:
    """Run the Hugging Face experts module ``experts`` through dispatch and combine over
    ``group`` for ``call``."""
    path, count, names = experts
    if call.stood_in(path):
        return
    call.override(call.structure.modules[path], "num_experts", count // group.size)

    def around(forward: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict) -> Tensor:
        x, ids, weights = (*args, *(kwargs[name] for name in names[len(args) :]))
        return dispatched(forward, x, ids, weights, count, group)

    call.intercept(path, Interception(around=around))


def dispatched(
    forward: Callable[..., Tensor],
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    experts: int,
    group: DispatchGroup,
) -> Tensor:
    """``x [T, H]`` to the ranks of its experts ``ids [T, k]``, through ``forward`` on this
    rank's experts (local ids, weight 1), and back weighted by ``weights [T, k]``."""
    layout = dispatch_layout(ids, experts, group.size)
    rows, sizes, handle = dispatch(x, ids, weights, layout, group)
    local = torch.arange(sizes.numel(), device=rows.device)
    local_ids = local.repeat_interleave(sizes, output_size=rows.shape[0])[:, None]
    ones = torch.ones(rows.shape[0], 1, dtype=weights.dtype, device=rows.device)
    out = forward(rows, local_ids, ones)
    if rows.requires_grad and not out.requires_grad:
        # No row reached this rank's experts, and transformers' eager loop returned zeros
        # that do not depend on them: tie the rows in, so that the backward still runs the
        # reverse all-to-all of the tokens, which the other ranks run (AFMoE's skewed routing).
        out = out + rows[:, :0].sum()
    return combine(out, handle)
