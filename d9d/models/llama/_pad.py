"""The padding token of a decoder's embedding: checked once for both d9d configs."""

from __future__ import annotations

from typing import Any

from d9d.errors import ConfigError

__all__ = ["check_pad_token_id"]


def check_pad_token_id(config: Any) -> None:
    """Raise unless ``config.pad_token_id`` is None or a row of the embedding.

    Raises:
        ConfigError: ``pad_token_id`` is not an int in ``[0, vocab_size)``.
    """
    pad, vocab = config.pad_token_id, config.vocab_size
    if pad is None:
        return
    if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < vocab:
        raise ConfigError(
            f"{type(config).__name__}.pad_token_id must be None or a token id in "
            f"[0, vocab_size={vocab}), got pad_token_id={pad!r}."
        )
