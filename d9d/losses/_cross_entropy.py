"""Token-level cross-entropy with ignored labels and an optional z-loss, in fp32."""

from __future__ import annotations

from typing import Literal

import torch

from ..errors import LabelError
from ._token_mean import token_mean
from ._vocab_parallel import is_vocab_sharded, sharded_lse_and_target

__all__ = ["cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    reduction: Literal["mean", "sum", "none"] = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``logits`` against integer ``labels``, skipping ``ignore_index``.

    The per-token loss is ``logsumexp(logits) - logits[label]``, computed in fp32 whatever
    the logits' dtype. With ``z_loss > 0`` each token adds ``z_loss * logsumexp(logits)**2``
    (PaLM's auxiliary loss, arXiv:2204.02311, which keeps the softmax normalizer near 1).
    Tokens labelled ``ignore_index`` contribute 0 to the loss and to the gradient. Any
    other label must be a class id in ``[0, V)``: eagerly, one outside raises
    :class:`~d9d.errors.LabelError` (whole or vocab-sharded logits alike; the check reads one
    value back). In a graph nothing is read back: with whole logits the label reaches the
    ``gather``, whose index ``d9d.jit`` checks before it runs (``IndexRangeError`` naming the
    batch input, donated params untouched); with vocab-sharded logits, whose shards never see
    the global label, such a token's loss is NaN (and so is a ``"mean"`` or ``"sum"``), with no
    gradient from it.
    ``"mean"`` divides by the number of valid tokens, and returns 0 (with zero gradients,
    not NaN) when every token is ignored. Shapes are static and no value is read back to
    Python, so it traces under ``torch.compile(fullgraph=True)`` without graph breaks.

    Logits sharded over the vocab (a DTensor ``Shard(-1)``, as ``tensor_parallel`` returns
    them) are never gathered: each rank reduces its shard and three all-reduces of one value
    per token give the log-sum-exp and the target logit (loss parallelism). The result is
    then a plain tensor, the same on every rank of the mesh. ``"mean"`` is
    :func:`token_mean`: inside a transformed step it is the mean over the valid tokens of the
    global batch (every data-parallel rank, cp rank and microbatch), so every layout equals
    one device fed the whole batch (``docs/losses.md``).

    Args:
        logits: Scores ``[..., V]``, any floating dtype.
        labels: Integer class ids ``[...]``, the leading shape of ``logits``.
        ignore_index: Label value of tokens to skip (default -100).
        z_loss: Weight of the z-loss term (default 0.0, off).
        reduction: ``"mean"`` over valid tokens (default), ``"sum"``, or ``"none"`` for the
            per-token losses ``[...]`` (0 at ignored tokens).

    Returns:
        A 0-d fp32 tensor, or fp32 ``[...]`` for ``reduction="none"``.

    Raises:
        ValueError: ``labels`` is not integer or its shape is not ``logits.shape[:-1]``,
            ``logits`` is not floating, ``reduction`` is unknown, or ``z_loss < 0``.
        LabelError: Eagerly, a label is neither in ``[0, V)`` nor ``ignore_index``.

    Example:
        >>> logits = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
        >>> labels = torch.tensor([0, -100])
        >>> round(cross_entropy(logits, labels).item(), 4)
        0.1269
    """
    _check_args(logits, labels, z_loss, reduction)
    # int64 before any arithmetic: a narrow dtype wraps comparisons and offsets (uint8 labels
    # read `labels >= 300` as `labels >= 44`), and gather takes only int32/int64 indices.
    labels = labels.long()
    dtype = torch.promote_types(logits.dtype, torch.float32)
    valid = labels != ignore_index
    outside = valid & ((labels < 0) | (labels >= logits.shape[-1]))
    if not torch.compiler.is_compiling():
        _check_labels(labels, outside, logits.shape[-1], ignore_index)
    sharded = is_vocab_sharded(logits)
    # Whole logits: an outside label stays for the gather, which d9d.jit's index guard checks.
    looked_up = valid & ~outside if sharded else valid
    safe_labels = torch.where(looked_up, labels, torch.zeros_like(labels))
    if sharded:
        lse, target = sharded_lse_and_target(logits, safe_labels, dtype)
    else:
        logits = logits.to(dtype)
        lse = torch.logsumexp(logits, dim=-1)
        target = logits.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    per_token = lse - target
    if z_loss:
        per_token = per_token + z_loss * lse.square()
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    per_token = torch.where(outside, torch.full_like(per_token, torch.nan), per_token)
    match reduction:
        case "none":
            return per_token
        case "sum":
            return per_token.sum()
        case _:
            return token_mean(per_token, valid)


def _check_labels(
    labels: torch.Tensor, outside: torch.Tensor, vocab: int, ignore_index: int
) -> None:
    if not outside.any():
        return
    where = outside.nonzero()[0]
    raise LabelError(
        f"cross_entropy labels must be in [0, {vocab}) or ignore_index={ignore_index}: got "
        f"{labels[tuple(where)].item()} at {tuple(where.tolist())} ({int(outside.sum())} such "
        f"labels in all); check the tokenizer's vocabulary against the model's ({vocab} logits) "
        "and the padding label"
    )


def _check_args(logits: torch.Tensor, labels: torch.Tensor, z_loss: float, reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy got {reduction=}; use one of {_REDUCTIONS}.")
    if not logits.is_floating_point():
        raise ValueError(f"cross_entropy needs floating logits, got {logits.dtype=}.")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(
            f"cross_entropy needs integer class ids as labels, got {labels.dtype=}; "
            f"pass token ids (e.g. labels.long()), not probabilities."
        )
    if logits.dim() == 0 or labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"cross_entropy needs labels of shape logits.shape[:-1], got "
            f"{tuple(logits.shape)=} and {tuple(labels.shape)=}."
        )
    if z_loss < 0:
        raise ValueError(f"cross_entropy needs z_loss >= 0, got {z_loss=}.")
