"""``Llama``: a pre-norm decoder with RoPE, grouped-query attention and a SwiGLU MLP."""

from __future__ import annotations

from typing import ClassVar

import torch

from ._config import LlamaConfig
from ._decoder import MLP, Attention, Block, Decoder

__all__ = ["Block", "Llama"]

_Device = torch.device | str | None


def _block(config: LlamaConfig, device: torch.device) -> Block:
    attn = Attention(config.dim, config.n_heads, config.n_kv_heads, config.head_dim, device=device)
    mlp = MLP(config.dim, config.ffn_dim, device=device)
    return Block(config.dim, config.norm_eps, attn, mlp, device=device)


class Llama(Decoder):
    """A Llama decoder: ``embed``, ``layers.{i}`` blocks, final ``norm``, output ``head``.

    Param paths are ``embed.weight``, ``layers.{i}.attn_norm.weight``,
    ``layers.{i}.attn.{wq,wk,wv,wo}.weight``, ``layers.{i}.mlp_norm.weight``,
    ``layers.{i}.mlp.{w_gate,w_up,w_down}.weight``, ``norm.weight`` and ``head.weight``
    (absent from ``named_parameters()`` when ``config.tie_embeddings``: the head then is the
    embedding matrix). :attr:`logical_axes` names the dims of each.

    Weights are initialized from ``config.seed`` alone (see :meth:`init_weights`), whatever
    the global RNG state. Built on the meta device (``device="meta"`` or under
    ``with torch.device("meta"):``) nothing is allocated or initialized; after
    ``to_empty(device=...)`` call :meth:`init_weights` (or restore a checkpoint). The module
    has no buffers: RoPE frequencies are recomputed in fp32 by each forward, so neither
    ``to_empty`` nor ``.to(torch.bfloat16)`` can leave them garbage or rounded.

    Args:
        config: Shapes, init scale and seed.
        device: Where params are created; default: the current default device.

    Example:
        >>> model = Llama(LlamaConfig.tiny())
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 256])
    """

    # Logical axis names per param dim, keyed by regexes over paths relative to this module
    # (matched with re.search); d9d.functionalize collects them and transforms map them to
    # mesh axes. Every param matches exactly one rule (tests/models/llama/test_llama_model.py).
    logical_axes: ClassVar[dict[str, tuple[str | None, ...]]] = {
        r"^embed\.weight$": ("vocab", "embed"),
        r"\.attn\.wq\.weight$": ("heads", "embed"),
        r"\.attn\.w[kv]\.weight$": ("kv_heads", "embed"),
        r"\.attn\.wo\.weight$": ("embed", "heads"),
        r"\.mlp\.w_(gate|up)\.weight$": ("mlp", "embed"),
        r"\.mlp\.w_down\.weight$": ("embed", "mlp"),
        r"(^|\.)(attn_norm|mlp_norm|norm)\.weight$": ("embed",),
        r"^head\.weight$": ("vocab", "embed"),
    }

    def __init__(self, config: LlamaConfig, *, device: _Device = None) -> None:
        super().__init__(
            config, config.head_dim, lambda _, meta: _block(config, meta), device=device
        )

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits ``[B, S, vocab_size]`` for ``tokens`` ``[B, S]``.

        Args:
            tokens: Integer token ids ``[B, S]`` with ``S <= config.max_seq_len``.
            positions: RoPE positions ``[S]`` of the tokens; default ``arange(S)``.
                Context parallelism passes each rank's slice of the global positions.

        Returns:
            Logits in the params' dtype, ``[B, S, vocab_size]``.

        Raises:
            ValueError: ``tokens`` is not 2-d or longer than ``max_seq_len``, or
                ``positions`` is not ``[S]``.
        """
        x, cos, sin = self.embed_and_rope(tokens, positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.logits(x)
