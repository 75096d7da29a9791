"""``Llama``: a pre-norm decoder with RoPE, grouped-query attention and a SwiGLU MLP."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from ._config import LlamaConfig
from ._ops import attention, rms_norm, rope, rope_cos_sin, rope_inv_freq, swiglu

__all__ = ["Llama"]

_Device = torch.device | str | None


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim with a learned ``weight`` (init ones)."""

    def __init__(self, dim: int, eps: float, *, device: _Device = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE; bias-free ``wq``, ``wk``, ``wv``, ``wo``."""

    def __init__(self, config: LlamaConfig, *, device: _Device = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        kv_dim = config.n_kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False, device=device)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False, device=device)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False, device=device)
        self.wo = nn.Linear(config.dim, config.dim, bias=False, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Head counts come from the projections (-1): under tensor parallelism each rank
        # holds n_heads / tp of them.
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        q, k = rope(q, k, cos, sin)  # d9d.kernels.rope rotates q and k in one call
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """SwiGLU MLP ``w_down(silu(w_gate(x)) * w_up(x))``, bias-free."""

    def __init__(self, config: LlamaConfig, *, device: _Device = None) -> None:
        super().__init__()
        self.w_gate = nn.Linear(config.dim, config.ffn_dim, bias=False, device=device)
        self.w_up = nn.Linear(config.dim, config.ffn_dim, bias=False, device=device)
        self.w_down = nn.Linear(config.ffn_dim, config.dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(swiglu(self.w_gate(x), self.w_up(x)))


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(attn_norm(x))``, then ``+ mlp(mlp_norm(.))``."""

    def __init__(self, config: LlamaConfig, *, device: _Device = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps, device=device)
        self.attn = Attention(config, device=device)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps, device=device)
        self.mlp = MLP(config, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
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
        super().__init__()
        self.config = config
        target = torch.empty(0, device=device).device  # honours `with torch.device(...)`
        # Built on meta, then materialized once: torch's default init would draw from (and
        # advance) the global RNG and cost a second pass over every weight.
        meta = torch.device("meta")
        self.embed = nn.Embedding(config.vocab_size, config.dim, device=meta)
        self.layers = nn.ModuleList(Block(config, device=meta) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, device=meta)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False, device=meta)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        if target != meta:
            self.to_empty(device=target)
            self.init_weights()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Llama:
        # Moving off the meta device (to_empty, .to) makes new Parameter objects per module,
        # which would silently untie the head; re-tie after every such conversion, as
        # nn.RNNBase re-flattens its weights in its own _apply.
        super()._apply(fn, recurse)
        if self.config.tie_embeddings:
            self.head.weight = self.embed.weight
        return self

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Re-initialize every param in place, deterministically.

        Each param is drawn from its own CPU ``torch.Generator`` seeded by ``(seed, path)``
        and copied to its device, so values depend only on the seed and the param path:
        not on the global RNG, the device, or which other params exist (a pipeline stage
        holding only some layers initializes them exactly as the whole model would).
        Embedding and linear weights are ``normal(0, init_std)``; ``wo`` and ``w_down``
        use ``init_std / sqrt(2 * n_layers)`` (GPT-2's residual scaling); norms are ones.

        Args:
            seed: Seed of the init; defaults to ``config.seed``.

        Example:
            >>> model = Llama(LlamaConfig.tiny(), device="meta")
            >>> model = model.to_empty(device="cpu")
            >>> model.init_weights()
            >>> bool(model.norm.weight.eq(1).all())
            True
        """
        seed = self.config.seed if seed is None else seed
        residual_std = self.config.init_std / math.sqrt(2 * self.config.n_layers)
        for path, param in self.named_parameters():
            if path.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            residual = path.endswith((".wo.weight", ".w_down.weight"))
            std = residual_std if residual else self.config.init_std
            generator = torch.Generator().manual_seed(_param_seed(seed, path))
            values = torch.empty(param.shape, dtype=torch.float32)
            values.normal_(0.0, std, generator=generator)
            param.copy_(values)

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
        if tokens.dim() != 2:
            raise ValueError(f"Llama expects tokens of shape [batch, seq], got {tokens.shape=}.")
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"Sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}: "
                f"truncate the batch or build the model with a larger max_seq_len."
            )
        if positions is None:
            positions = torch.arange(seq, device=tokens.device)
        elif positions.shape != (seq,):
            raise ValueError(
                f"positions must have shape [seq] = ({seq},) to match {tokens.shape=}, "
                f"got {positions.shape=}."
            )
        x = self.embed(tokens)
        inv_freq = rope_inv_freq(self.config.head_dim, self.config.rope_theta, device=x.device)
        cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def _param_seed(seed: int, path: str) -> int:
    """A 63-bit seed for the param at ``path``, stable across processes and Python versions."""
    digest = hashlib.blake2b(f"{seed}:{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
