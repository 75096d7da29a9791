"""The mean over the valid tokens of the global batch: the one loss normalization of d9d."""

from __future__ import annotations

import torch

from ..core._context import current, record_tokens

__all__ = ["token_mean"]

_c10d = torch.ops._c10d_functional


def token_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` over the positions where ``valid`` is true, in the whole batch.

    Outside a transformed step this is the masked mean on this process. Inside one, the
    count of valid tokens is summed over every mesh axis on which ranks hold different tokens
    (the data axes of ``shard_params`` and the ``cp`` axis of ``context_parallel``; one
    all-reduce of one integer per axis), and the rank returns its sum times the number of
    those ranks over that count. The step averages losses and grads over the same ranks, so
    the result is the mean over the valid tokens of the global batch, however unevenly
    ignored labels fall. Under ``shard_params(microbatches=k)`` and ``pipeline``,
    ``value_and_grad`` weighs each microbatch by the count it records here, so the step's loss
    is still the mean over all of the step's valid tokens. Use it for any per-token loss you
    write yourself; :func:`cross_entropy` uses it. With no valid token it returns 0 (and zero
    gradients), not NaN. Half-precision values are summed and divided in float32, and the
    mean stays there (as :func:`cross_entropy`'s): in their own dtype a float16 sum
    overflows past 65504 and a bfloat16 one rounds to 8 bits, and under microbatches the
    mean's grad is the microbatch's token count, which a float16 value could not carry.

    Args:
        values: Per-token values, any shape, floating.
        valid: Booleans of the same shape; false positions are left out (their values may be
            anything finite).

    Returns:
        A 0-d tensor of ``values``' dtype, or float32 where that is wider (a half dtype).

    Raises:
        ValueError: ``valid`` is not boolean or its shape differs from ``values``'.

    Example:
        >>> values = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
        >>> token_mean(values, torch.tensor([[True, False], [True, True]]))
        tensor(3.)
    """
    if valid.dtype != torch.bool or valid.shape != values.shape:
        raise ValueError(
            f"token_mean needs a boolean mask shaped like the values, got {valid.dtype=} "
            f"{tuple(valid.shape)=} for {tuple(values.shape)=}; pass e.g. labels != -100"
        )
    count = valid.sum()
    step = current()
    ranks = 1
    for group, size in step.plan.token_groups if step is not None else ():
        count = _c10d.wait_tensor(_c10d.all_reduce(count, "sum", group))
        ranks *= size
    record_tokens(count)
    wide = values.to(torch.promote_types(values.dtype, torch.float32))
    total = torch.where(valid, wide, torch.zeros_like(wide)).sum()
    return total * ranks / count.clamp(min=1)
