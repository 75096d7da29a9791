"""``d9d train --eval-every``: the loss on tokens held out of training, forward only, under
the training step's transforms (so on its mesh, with its sharded params)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ... import data, losses
from ...core._model import Model
from ...core._step import TransformedStep
from ...errors import DataError

__all__ = ["Evaluator", "split_held_out"]


def split_held_out(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train, held_out)``: the token stream without, and with only, its last ``fraction``
    (at least one token each way); the same split for every run on the same data."""
    held = min(max(math.ceil(tokens.size * fraction), 1), tokens.size - 1)
    return tokens[: tokens.size - held], tokens[tokens.size - held :]


def _eval_step(model: Model) -> Callable[..., Any]:
    """``step(params, opt_state, batch) -> (params, opt_state, {"loss": ...})``: the next-token
    cross entropy, no grads, nothing updated (a Llama's logits, or an MoE's ``.logits``)."""

    def step(params: Any, opt_state: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, Any, Any]:
        with torch.no_grad():
            out = model.apply(params, batch["tokens"])
            logits = getattr(out, "logits", out)
            return params, opt_state, {"loss": losses.cross_entropy(logits, batch["labels"])}

    return step


class Evaluator:
    """The mean loss over the first ``batches`` batches of the held-out tokens.

    Args:
        model: The functionalized model being trained.
        train_step: The training step before ``jit``: a transformed step lends its plan.
        held_out: The held-out tokens.
        batches: Batches per evaluation.
        batch_size: Sequences per batch over all data-parallel ranks.
        seq_len: Tokens per sequence.
        device: Where the batches go.

    Raises:
        DataError: The held-out tokens are too few for one batch.
    """

    def __init__(
        self,
        model: Model,
        train_step: Any,
        held_out: np.ndarray,
        *,
        batches: int,
        batch_size: int,
        seq_len: int,
        device: torch.device,
    ) -> None:
        step = _eval_step(model)
        shard = (0, 1)
        if isinstance(train_step, TransformedStep):
            step = train_step.sharing_plan(step)
            shard = train_step.data_rank()
        try:
            self._loader = data.TokenLoader(
                held_out,
                global_batch_size=batch_size,
                seq_len=seq_len,
                dp_rank=shard[0],
                dp_size=shard[1],
            )
        except DataError as error:
            raise DataError(
                f"the held-out tokens ({held_out.size}) are too few for one eval batch of "
                f"{batch_size} x {seq_len + 1} tokens: raise --eval-fraction, or lower "
                f"--batch-size or --seq-len ({error})"
            ) from None
        windows = data.num_windows(held_out.size, seq_len)
        if windows < batches * batch_size:  # the loader would wrap: windows seen twice
            raise DataError(
                f"the held-out tokens ({held_out.size}) pack into {windows} windows of "
                f"{seq_len + 1} tokens, fewer than --eval-batches {batches} x --batch-size "
                f"{batch_size} = {batches * batch_size} sequences: each would be evaluated "
                f"more than once; raise --eval-fraction, or lower --eval-batches"
            )
        self._module = model.module
        self._step = step
        self._batches = batches
        self._device = device

    def __call__(self, params: Any) -> dict[str, float]:
        """``eval_loss`` (nats per token) and ``eval_perplexity`` of ``params``, with every
        module in eval mode (dropout off) and each put back in its own mode afterwards."""
        modes = [(module, module.training) for module in self._module.modules()]
        self._module.eval()
        total = 0.0
        try:
            for index in range(self._batches):
                batch = {k: v.to(self._device) for k, v in self._loader.batch(index).items()}
                _, _, metrics = self._step(params, None, batch)
                total += float(metrics["loss"])
        finally:
            for module, training in modes:
                module.training = training
        loss = total / self._batches  # every batch holds as many tokens, none ignored
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}
