"""``master_weights``: low-precision params updated through float32 copies in the optimizer state.

Params stored in bfloat16 halve their bytes, but an update below half an ulp of a param is
lost when it is added in bfloat16. Mixed-precision training (Micikevicius et al. 2018; ZeRO's
"4Ψ + 12Ψ/N") keeps a float32 master copy of each such param as optimizer state: the
optimizer updates the master, and the param is the master rounded to nearest. As state, the
masters are laid out as the optimizer state is: sharded over ``fsdp`` with ZeRO-1/2/3, so
only the whole params (ZeRO-1/2) pay for the narrow dtype's saving.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from d9d import tree
from d9d.optim._transform import (
    GradientTransformation,
    apply_updates,
    by_kind,
    check_same_layout,
    check_state,
)

__all__ = ["MasterWeightsState", "master_weights"]


class MasterWeightsState(NamedTuple):
    """State of ``master_weights``."""

    # {param path: its master copy in the master dtype}, for the params narrower than it.
    master: dict[str, Any]
    # The wrapped transformation's state, built on the masters (e.g. float32 moments).
    inner_state: Any


def master_weights(
    inner: GradientTransformation, dtype: torch.dtype = torch.float32
) -> GradientTransformation:
    """Run ``inner`` on ``dtype`` master copies of the params narrower than ``dtype``.

    ``init`` copies each floating param narrower than ``dtype`` (a bfloat16 or float16 param
    for float32) into the state, and builds ``inner``'s state on those masters, so its
    moments take the masters' dtype. ``update`` casts such a param's grad to ``dtype``, runs
    ``inner`` with the masters in place of those params, adds its update to the master in
    ``dtype``, and returns the new master minus the param (in ``dtype``): ``apply_updates``,
    which adds in the wider dtype and rounds once, lands the param on the new master rounded
    to nearest (exactly so unless the update cancels the param to below ``2**-15`` of its
    magnitude, as ``stochastic_round`` says of the same subtraction). Params of ``dtype`` or
    wider get ``inner``'s update unchanged, and keep no copy. Make it the last
    transformation of a ``chain`` (it must see the final update), e.g.
    ``master_weights(chain(clip_by_global_norm(1.0), adamw(...)))``.

    The masters are optimizer state laid out like their params, so ``shard_params`` shards
    them as it shards the moments: with ``shard="opt_state"`` (ZeRO-1) and bfloat16 params,
    a rank holds 2 bytes a param of params, 2 of grads and 12/N of masters and AdamW
    moments (``docs/sharding.md``).

    Args:
        inner: the transformation to run on the masters (e.g. ``adamw(...)``).
        dtype: the masters' dtype, a floating dtype of 4 bytes or more (default float32).

    Returns:
        A ``GradientTransformation`` with state ``MasterWeightsState(master, inner_state)``;
        its ``update`` needs ``params``.

    Raises:
        TypeError: ``inner`` is not a ``GradientTransformation``.
        ValueError: ``dtype`` is not a floating dtype of 4 bytes or more; at ``update``, no
            ``params``.

    Example:
        >>> import torch, d9d.optim as optim
        >>> opt = optim.master_weights(optim.sgd(1.0))
        >>> params = {"w": torch.ones(2, dtype=torch.bfloat16)}
        >>> state = opt.init(params)
        >>> grads = {"w": torch.full((2,), -1e-3, dtype=torch.bfloat16)}
        >>> for _ in range(8):  # +0.001 a step: an eighth of an ulp at 1.0, lost in bfloat16
        ...     updates, state = opt.update(grads, state, params)
        ...     params = optim.apply_updates(params, updates)
        >>> params["w"]  # 1.008 rounded to bfloat16
        tensor([1.0078, 1.0078], dtype=torch.bfloat16)
        >>> state.master["w"].dtype
        torch.float32
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"master_weights() wraps a GradientTransformation, got {inner!r}; "
            "pass one built by d9d.optim, e.g. master_weights(d9d.optim.adamw(1e-3))"
        )
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 4):
        raise ValueError(
            "master_weights keeps the masters in dtype, a floating dtype of 4 bytes or more "
            f"(torch.float32, torch.float64), got {dtype=}"
        )

    def narrow(param: torch.Tensor) -> bool:
        return param.dtype.is_floating_point and param.dtype.itemsize < dtype.itemsize

    def init(params: Any) -> MasterWeightsState:
        named = tree.flatten_with_paths(params)[0]
        master = {path: p.detach().to(dtype) for path, p in named if narrow(p)}
        return MasterWeightsState(master, inner.init(_working(params, master)))

    def update(
        updates: Any, state: MasterWeightsState, params: Any = None
    ) -> tuple[Any, MasterWeightsState]:
        check_state(state, MasterWeightsState, "master_weights")
        if params is None:
            raise ValueError(
                "master_weights returns each param's step to its new master, so its update "
                "needs the params: call opt.update(grads, opt_state, params)"
            )
        check_same_layout(params, updates, what="grads")
        named, spec = tree.flatten_with_paths(updates)
        cast = [g.to(dtype) if path in state.master else g for path, g in named]
        working = _working(params, state.master)
        steps, inner_state = inner.update(tree.unflatten(spec, cast), state.inner_state, working)
        by_path = {path: u for (path, _), u in zip(named, tree.leaves(steps), strict=True)}
        paths = list(state.master)
        master = apply_updates(state.master, {p: by_path[p] for p in paths})
        narrow_params = dict(tree.flatten_with_paths(params)[0])
        (to_master,) = by_kind(
            lambda news, olds: (torch._foreach_sub(news, [o.to(dtype) for o in olds]),),
            [master[p] for p in paths],
            [narrow_params[p] for p in paths],
            outputs=1,
        )
        by_path.update(zip(paths, to_master, strict=True))
        out = tree.unflatten(spec, [by_path[path] for path, _ in named])
        return out, MasterWeightsState(master, inner_state)

    return GradientTransformation(init, update)


def _working(params: Any, master: dict[str, Any]) -> Any:
    """``params`` with each param that has a master replaced by it."""
    named, spec = tree.flatten_with_paths(params)
    return tree.unflatten(spec, [master.get(path, p) for path, p in named])
