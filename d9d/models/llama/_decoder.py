"""The pre-norm RoPE decoder both d9d model families are built on: its norm, attention, MLP,
block, and the ``Decoder`` base holding ``embed``, ``layers``, ``norm`` and ``head``.

:class:`d9d.models.Llama` fills ``layers`` with dense blocks; :class:`d9d.models.MoE` swaps the
MLP of some blocks for a :class:`d9d.moe.MoE` layer and adds per-head q/k norms. Param paths
are the same in both (``layers.{i}.attn.wq.weight``, ``layers.{i}.mlp.w_gate.weight``, ...),
so checkpoints and the Hugging Face converters see one layout.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from ...core._context import sequence_length
from ._ops import attention, rms_norm, rope, rope_cos_sin, rope_inv_freq, swiglu

__all__ = ["MLP", "Attention", "Block", "Decoder", "RMSNorm"]

_Device = torch.device | str | None

# The logical axis of a norm over all heads' queries or keys (OLMoE's q_norm/k_norm): no
# tensor_parallel rule maps it, so sharding the heads over tp is refused with this name.
_FULL_QK_NORM_AXIS = (
    "norm over all heads of q or k (qk_norm='full'), whose statistics would span the tp "
    "ranks (not implemented by d9d)"
)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim with a learned ``weight`` (init ones)."""

    def __init__(self, dim: int, eps: float, *, device: _Device = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE; bias-free ``wq``, ``wk``, ``wv``, ``wo``
    and, with ``qk_norm``, an RMSNorm ``q_norm``/``k_norm`` of queries and keys before RoPE:
    per head (``True``, width ``head_dim``: Qwen3) or over all heads at once (``"full"``,
    widths ``n_heads * head_dim`` and ``n_kv_heads * head_dim``: OLMoE).

    A ``"full"`` norm's statistics span every head, so its weights name a logical axis no
    ``tensor_parallel`` rule maps: sharding the heads over ``tp`` is refused by name.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool | Literal["full"] = False,
        norm_eps: float = 1e-6,
        device: _Device = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.full_qk_norm = qk_norm == "full"
        q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
        self.wq = nn.Linear(dim, q_dim, bias=False, device=device)
        self.wk = nn.Linear(dim, kv_dim, bias=False, device=device)
        self.wv = nn.Linear(dim, kv_dim, bias=False, device=device)
        self.wo = nn.Linear(q_dim, dim, bias=False, device=device)
        q_width, k_width = (q_dim, kv_dim) if self.full_qk_norm else (head_dim, head_dim)
        self.q_norm = RMSNorm(q_width, norm_eps, device=device) if qk_norm else None
        self.k_norm = RMSNorm(k_width, norm_eps, device=device) if qk_norm else None
        if self.full_qk_norm:  # found by d9d.functionalize before the decoder's own rules
            self.logical_axes = {r"^[qk]_norm\.weight$": (_FULL_QK_NORM_AXIS,)}

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Head counts come from the projections' widths: under tensor parallelism each rank
        # holds n_heads / tp of them (not -1, which an empty batch leaves ambiguous).
        batch, seq, _ = x.shape
        q, k = self.wq(x), self.wk(x)
        if self.full_qk_norm:
            if q.shape[-1] != self.wo.in_features:  # axes overridden to shard the heads
                raise ValueError(
                    f"qk_norm='full' normalizes all {self.wo.in_features} query features at "
                    f"once, but this rank holds {q.shape[-1]} of them: its heads are sharded "
                    "(tensor_parallel), which such a norm does not support; use qk_norm=True "
                    "(per head) or keep the heads whole."
                )
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq, q.shape[-1] // self.head_dim, self.head_dim)
        k = k.view(batch, seq, k.shape[-1] // self.head_dim, self.head_dim)
        if self.q_norm is not None and not self.full_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k, cos, sin)  # d9d.kernels.rope rotates q and k in one call
        v = self.wv(x)
        v = v.view(batch, seq, v.shape[-1] // self.head_dim, self.head_dim)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(batch, seq, q.shape[2] * self.head_dim))


class MLP(nn.Module):
    """SwiGLU MLP ``w_down(silu(w_gate(x)) * w_up(x))``, bias-free."""

    def __init__(self, dim: int, hidden: int, *, device: _Device = None) -> None:
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False, device=device)
        self.w_up = nn.Linear(dim, hidden, bias=False, device=device)
        self.w_down = nn.Linear(hidden, dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(swiglu(self.w_gate(x), self.w_up(x)))


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(attn_norm(x))``, then ``+ mlp(mlp_norm(.))``."""

    def __init__(
        self, dim: int, norm_eps: float, attn: Attention, mlp: nn.Module, *, device: _Device = None
    ) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim, norm_eps, device=device)
        self.attn = attn
        self.mlp_norm = RMSNorm(dim, norm_eps, device=device)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """``embed``, ``layers.{i}`` (the blocks ``make_block(i, device)`` builds), ``norm`` and
    ``head`` (tied to ``embed`` with ``config.tie_embeddings``), and their deterministic init.

    Built on the meta device, then materialized once on ``device`` and initialized by
    :meth:`init_weights` (nothing is allocated when ``device`` is meta). Subclasses write
    ``forward`` from :meth:`embed_and_rope`, the blocks and :meth:`logits`.

    Args:
        config: A config with ``vocab_size``, ``dim``, ``n_layers``, ``norm_eps``,
            ``tie_embeddings``, ``init_std``, ``seed``, ``max_seq_len``, ``rope_theta`` and
            ``pad_token_id``.
        head_dim: Width of one attention head (RoPE's rotation size).
        make_block: ``(layer index, device) -> block``.
        device: Where params are created; default: the current default device.
    """

    # Params ending so are drawn with init_std / sqrt(2 * n_layers) (GPT-2's residual
    # scaling), and params ending so are zeros; every other non-norm param is normal(0, std).
    residual_suffixes: tuple[str, ...] = (".wo.weight", ".w_down.weight")
    zero_suffixes: tuple[str, ...] = ()

    def __init__(
        self,
        config: Any,
        head_dim: int,
        make_block: Callable[[int, torch.device], nn.Module],
        *,
        device: _Device = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.head_dim = head_dim
        target = torch.empty(0, device=device).device  # honours `with torch.device(...)`
        # Built on meta, then materialized once: torch's default init would draw from (and
        # advance) the global RNG and cost a second pass over every weight.
        meta = torch.device("meta")
        self.embed = nn.Embedding(
            config.vocab_size, config.dim, padding_idx=config.pad_token_id, device=meta
        )
        self.layers = nn.ModuleList(make_block(i, meta) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, device=meta)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False, device=meta)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        if target != meta:
            self.to_empty(device=target)
            self.init_weights()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Decoder:
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
        Embedding and linear weights are ``normal(0, init_std)``; output projections
        (``wo``, ``w_down``) use ``init_std / sqrt(2 * n_layers)`` (GPT-2's residual
        scaling); norms are ones; the embedding row of ``config.pad_token_id`` is zeros.

        Args:
            seed: Seed of the init; defaults to ``config.seed``.

        Example:
            >>> from d9d.models import Llama, LlamaConfig
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
            if path.endswith(self.zero_suffixes):
                param.zero_()
                continue
            residual = path.endswith(self.residual_suffixes)
            std = residual_std if residual else self.config.init_std
            generator = torch.Generator().manual_seed(_param_seed(seed, path))
            values = torch.empty(param.shape, dtype=torch.float32)
            values.normal_(0.0, std, generator=generator)
            param.copy_(values)
        if self.embed.padding_idx is not None:  # as nn.Embedding and transformers start it
            self.embed.weight[self.embed.padding_idx].zero_()

    def embed_and_rope(
        self, tokens: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x, cos, sin)``: the embedded ``tokens [B, S]`` and the RoPE tables at
        ``positions [S]`` (default ``arange(S)``), after checking both.

        Raises:
            TypeError: ``tokens`` is not a tensor (a list of ids).
            ValueError: ``tokens`` is not 2-d or its sequence (the whole one, under
                ``context_parallel``) is longer than ``max_seq_len``, or ``positions`` is not
                ``[S]``.
        """
        name = type(self).__name__
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(
                f"{name} expects tokens as a tensor of shape [batch, seq], got "
                f"{type(tokens).__name__}; pass torch.tensor(tokens)."
            )
        if tokens.dim() != 2:
            raise ValueError(f"{name} expects tokens of shape [batch, seq], got {tokens.shape=}.")
        seq = tokens.shape[1]
        whole = sequence_length(seq)  # under context_parallel, tokens hold a slice of it
        if whole > self.config.max_seq_len:
            raise ValueError(
                f"Sequence length {whole} exceeds max_seq_len={self.config.max_seq_len}: "
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
        inv_freq = rope_inv_freq(self.head_dim, self.config.rope_theta, device=x.device)
        cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
        return x, cos, sin

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output head on the final norm of the residual stream ``x``."""
        return self.head(self.norm(x))


def _param_seed(seed: int, path: str) -> int:
    """A 63-bit seed for the param at ``path``, stable across processes and Python versions."""
    digest = hashlib.blake2b(f"{seed}:{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
