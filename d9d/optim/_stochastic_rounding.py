"""``stochastic_round``: bfloat16 params updated in float32 and rounded stochastically.

A bfloat16 param keeps 8 significant bits, so an update below half an ulp of the param
(``lr * step`` against a weight of size 1: anything under 2**-9) is lost by round-to-nearest
every step. Stochastic rounding rounds ``p.float() + update`` up with the probability of its
distance from the lower neighbour, so the rounded param is the float32 one in expectation.

The random bits are a hash of ``(seed, step, the param's path, the element's index in the
global param)`` (counter-based, as Philox or JAX's ``threefry`` are), not draws from a
generator's stream:
a shard of a param draws the bits the whole param draws at the same elements, so a sharded
step rounds bitwise as one device does, and a resumed run as the uninterrupted one.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from d9d import tree
from d9d.core._gather import local_like
from d9d.optim._offloaded import check_not_offloaded
from d9d.optim._transform import GradientTransformation, check_same_layout, check_state, zero_count

__all__ = ["StochasticRoundState", "stochastic_round", "stochastic_round_to_bfloat16"]

_LOW_32 = 0xFFFFFFFF
# The bits of a float32 that bfloat16 drops: its 16 low mantissa bits.
_DROPPED_BITS = 16
_KEPT = -(1 << _DROPPED_BITS)  # int32 0xFFFF0000: sign, exponent and bfloat16's mantissa


class StochasticRoundState(NamedTuple):
    """State of ``stochastic_round``."""

    # 0-d int64 tensor: the number of updates done so far (the step part of the hash key).
    count: torch.Tensor
    # The wrapped transformation's state.
    inner_state: Any


def stochastic_round(inner: GradientTransformation, *, seed: int = 0) -> GradientTransformation:
    """Round bfloat16 params stochastically after ``inner``'s update.

    For each bfloat16 param ``p`` and ``inner``'s update ``u``, the new param is
    ``p.float() + u.float()`` rounded to bfloat16 up or down with probabilities that make
    it unbiased (:func:`stochastic_round_to_bfloat16`); the returned update is that value
    minus ``p`` in float32, so ``apply_updates`` (which adds in the wider dtype, once) lands
    on it. Exactly so unless the update cancels the param to below ``2**-15`` of its
    magnitude, where ``fl32(new - p)`` is inexact and the result is off by at most
    ``2**-24 |p|``. Params of other dtypes (float32 masters, float64) get ``inner``'s update
    unchanged. Pair it with ``adamw(..., mu_dtype=torch.float32)`` or bfloat16 moments:
    the moments of bfloat16 params are otherwise bfloat16 math too. It must see the final
    update: make it the last transformation of a ``chain`` (wrap the whole optimizer, or
    ``chain(clip_by_global_norm(1.0), stochastic_round(adamw(...)))``).

    The random bits hash ``seed``, the step count, the param's path (so params of one shape
    do not round alike) and each element's index in the global param, so a param sharded
    over a mesh (a DTensor with ``Shard``/``Replicate`` placements) rounds bitwise as the
    whole param on one device, and replicas agree.

    Args:
        inner: the transformation whose updates are applied (e.g. ``adamw(...)``).
        seed: an int in [0, 2**32) keying the random bits (default 0).

    Returns:
        A ``GradientTransformation`` with state ``StochasticRoundState(count, inner_state)``;
        its ``update`` needs ``params``.

    Raises:
        TypeError: ``inner`` is not a ``GradientTransformation``.
        ValueError: ``seed`` out of range; at ``init``, a float16 param (its 5-bit exponent
            is not float32's: not built, store it in bfloat16 or float32); at ``update``,
            no ``params``.
        PlanError: at ``update``, it runs inside ``offloaded``, which hands it shards
            without their place in the param: wrap ``offloaded`` in it instead.

    Example:
        >>> import torch, d9d.optim as optim
        >>> opt = optim.stochastic_round(optim.sgd(1.0), seed=0)
        >>> params = {"w": torch.ones(1000, dtype=torch.bfloat16)}
        >>> grads = {"w": torch.full((1000,), -1e-3)}  # +0.001: an eighth of an ulp at 1.0
        >>> updates, state = opt.update(grads, opt.init(params), params)
        >>> new = optim.apply_updates(params, updates)["w"]
        >>> sorted(set(new.tolist()))  # the two neighbours of 1.001
        [1.0, 1.0078125]
        >>> round(new.float().mean().item(), 3)  # 1.001 in expectation
        1.001
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"stochastic_round() wraps a GradientTransformation, got {inner!r}; "
            "pass one built by d9d.optim, e.g. stochastic_round(d9d.optim.adamw(1e-3))"
        )
    if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= _LOW_32):
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed=}")

    def init(params: Any) -> StochasticRoundState:
        for path, param in zip(tree.paths(params), tree.leaves(params), strict=True):
            if param.dtype == torch.float16:
                raise ValueError(
                    f"stochastic_round rounds to bfloat16, but param {path!r} is float16 "
                    "(stochastic rounding to float16 is not built): store it in bfloat16, "
                    "or in float32 with shard_params(param_dtype=torch.float16) to compute in it"
                )
        return StochasticRoundState(count=zero_count(params), inner_state=inner.init(params))

    def update(
        updates: Any, state: StochasticRoundState, params: Any = None
    ) -> tuple[Any, StochasticRoundState]:
        check_state(state, StochasticRoundState, "stochastic_round")
        if params is None:
            raise ValueError(
                "stochastic_round rounds the new params, so its update needs them: call "
                "opt.update(grads, opt_state, params)"
            )
        check_not_offloaded(
            "stochastic_round",
            "a shard's elements would draw the random bits of the param's first elements, "
            "the same on every rank, not their own",
            "wrap offloaded in it instead, on the device: stochastic_round(offloaded(adamw(...)))",
        )
        updates, inner_state = inner.update(updates, state.inner_state, params)
        check_same_layout(params, updates, what="updates")
        count = state.count + 1
        key = _mix(_mix(count & _LOW_32) ^ seed)
        named, spec = tree.flatten_with_paths(params)
        rounded = [
            _rounded_update(p, u, _mix(key ^ _path_salt(path))) if p.dtype == torch.bfloat16 else u
            for (path, p), u in zip(named, tree.leaves(updates), strict=True)
        ]
        return tree.unflatten(spec, rounded), StochasticRoundState(count, inner_state)

    return GradientTransformation(init, update)


def stochastic_round_to_bfloat16(x: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16, up in magnitude with probability of its distance.

    ``random_bits`` (integers in [0, 2**16), shaped like ``x``) are added to the 16 float32
    mantissa bits that bfloat16 drops, and those bits are then cut off: ``x`` moves to the
    next bfloat16 away from zero exactly when the bits carry, which uniform bits do with
    probability ``(|x| - |lower|) / ulp``. Values that are bfloat16 already stay; infinities
    stay infinite.

    Example:
        >>> import torch
        >>> x = torch.full((4,), 1.0 + 2**-9)  # a quarter of the way from 1.0 to 1.0078125
        >>> stochastic_round_to_bfloat16(x, torch.tensor([0, 49151, 49152, 65535]))
        tensor([1.0000, 1.0000, 1.0078, 1.0078], dtype=torch.bfloat16)
    """
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    carried = (bits + random_bits.to(torch.int32)) & _KEPT
    return carried.view(torch.float32).to(torch.bfloat16)


def _rounded_update(param: Any, update: Any, key: torch.Tensor) -> Any:
    """The float32 update that takes bfloat16 ``param`` to its stochastically rounded sum."""
    if not isinstance(param, DTensor):
        return _rounded_local(param, update, key, (0,) * param.ndim, tuple(param.shape))
    if not isinstance(update, DTensor):
        raise ValueError(
            "stochastic_round got a plain-tensor update for a DTensor param; the optimizer's "
            "updates must be laid out like the params (pass the params from step.place)"
        )
    if update.device_mesh != param.device_mesh or update.placements != param.placements:
        update = update.redistribute(param.device_mesh, param.placements)
    _, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    local = _rounded_local(
        param.to_local(), update.to_local(), key, tuple(offset), tuple(param.shape)
    )
    return local_like(local, param)


def _rounded_local(
    param: torch.Tensor,
    update: torch.Tensor,
    key: torch.Tensor,
    offset: tuple[int, ...],
    global_shape: tuple[int, ...],
) -> torch.Tensor:
    """``_rounded_update`` of a local shard starting at ``offset`` in the global param."""
    new = param.float() + update.float()
    index = _global_index(tuple(param.shape), offset, global_shape, param.device)
    bits = _mix(_mix((index & _LOW_32) ^ key) ^ (index >> 32))
    rounded = stochastic_round_to_bfloat16(new, bits & ((1 << _DROPPED_BITS) - 1))
    return rounded.float() - param.float()


def _global_index(
    local_shape: tuple[int, ...],
    offset: tuple[int, ...],
    global_shape: tuple[int, ...],
    device: torch.device,
) -> torch.Tensor:
    """The row-major index in the global tensor of each element of the local shard."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(global_shape))):
        start = offset[dim]
        along = torch.arange(start, start + local_shape[dim], dtype=torch.int64, device=device)
        shape = [1] * len(global_shape)
        shape[dim] = local_shape[dim]
        index = index + (along * stride).view(shape)
        stride *= global_shape[dim]
    return index.expand(local_shape)


def _path_salt(path: str) -> int:
    """32-bit FNV-1a of ``path``: plain Python, so Dynamo folds it into a constant (it cannot
    trace ``zlib.crc32``), and the same in every process (``hash(str)`` is salted per process)."""
    salt = 0x811C9DC5
    for char in path:
        salt = ((salt ^ ord(char)) * 0x01000193) & _LOW_32
    return salt


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two xorshift-multiply rounds, constant 0x45d9f3b) of ``x`` in
    [0, 2**32), held in int64 so no product overflows (2**32 * 2**27 < 2**63)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _LOW_32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _LOW_32
    return (x >> 16) ^ x
