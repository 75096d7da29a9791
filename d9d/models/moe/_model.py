"""``MoE``: a pre-norm RoPE decoder whose MLPs (after the first ``n_dense_layers``) are
``d9d.moe.MoE`` layers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from d9d.moe import MoE as MoELayer

from ..llama._model import RMSNorm, _param_seed
from ..llama._ops import attention, rope, rope_cos_sin, rope_inv_freq, swiglu
from ._config import MoEConfig

__all__ = ["MoE", "MoEModelOutput"]

_Device = torch.device | str | None


class MoEModelOutput(NamedTuple):
    """What :class:`MoE` returns."""

    logits: torch.Tensor  # [B, S, vocab_size] in the params' dtype
    aux_loss: torch.Tensor  # 0-d float32: the MoE layers' aux losses summed, to add to the loss
    expert_load: dict[str, torch.Tensor]  # {"layers.{i}.mlp": [E] global choices per expert}


class Attention(nn.Module):
    """Causal GQA with RoPE; ``wq``, ``wk``, ``wv``, ``wo`` and, with ``qk_norm``, per-head
    ``q_norm``/``k_norm``."""

    def __init__(self, config: MoEConfig, *, device: _Device = None) -> None:
        super().__init__()
        self.head_dim = head_dim = config.attention_head_dim
        q_dim, kv_dim = config.n_heads * head_dim, config.n_kv_heads * head_dim
        self.wq = nn.Linear(config.dim, q_dim, bias=False, device=device)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False, device=device)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False, device=device)
        self.wo = nn.Linear(q_dim, config.dim, bias=False, device=device)
        norm = config.qk_norm
        self.q_norm = RMSNorm(head_dim, config.norm_eps, device=device) if norm else None
        self.k_norm = RMSNorm(head_dim, config.norm_eps, device=device) if norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k, cos, sin)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """Dense SwiGLU MLP ``w_down(silu(w_gate(x)) * w_up(x))``."""

    def __init__(self, dim: int, hidden: int, *, device: _Device = None) -> None:
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False, device=device)
        self.w_up = nn.Linear(dim, hidden, bias=False, device=device)
        self.w_down = nn.Linear(hidden, dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(swiglu(self.w_gate(x), self.w_up(x)))


class Block(nn.Module):
    """Pre-norm block; returns ``(x, aux_loss, load)``, the last two None for a dense MLP."""

    def __init__(self, config: MoEConfig, dense: bool, *, device: _Device = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps, device=device)
        self.attn = Attention(config, device=device)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps, device=device)
        self.dense = dense  # not isinstance(self.mlp, MLP): a runtime may intercept self.mlp
        self.mlp: nn.Module = (
            MLP(config.dim, config.ffn_dim, device=device)
            if dense
            else MoELayer(config.moe, device=device)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        out = self.mlp(self.mlp_norm(x))
        if self.dense:
            return x + out, None, None
        return x + out.out, out.aux_loss, out.load


class MoE(nn.Module):
    """A DeepSeek/Qwen3-style MoE decoder: ``embed``, ``layers.{i}``, ``norm``, ``head``.

    Block ``i`` holds ``attn_norm``, ``attn.{wq,wk,wv,wo}`` (and ``attn.{q,k}_norm``),
    ``mlp_norm`` and ``mlp``: a dense SwiGLU MLP for ``i < n_dense_layers``, else a
    :class:`d9d.moe.MoE` (``mlp.router.weight``, ``mlp.experts.w_{gate,up,down}``, ...).
    :attr:`logical_axes` names every param's dims; the MoE layers declare theirs. Weights are
    drawn per param from ``(seed, path)`` as in :class:`d9d.models.Llama`; built on the meta
    device nothing is allocated.

    The forward returns :class:`MoEModelOutput`: the logits, the summed aux loss and each MoE
    layer's global expert load, keyed by layer path, which a training step passes to
    :func:`d9d.moe.update_router_bias`.

    Args:
        config: Shapes, MoE options, init scale and seed.
        device: Where params are created.

    Example:
        >>> model = MoE(MoEConfig.tiny())
        >>> out = model(torch.zeros(2, 8, dtype=torch.long))
        >>> out.logits.shape, list(out.expert_load)
        (torch.Size([2, 8, 256]), ['layers.1.mlp'])
    """

    logical_axes: ClassVar[dict[str, tuple[str | None, ...]]] = {
        r"^embed\.weight$": ("vocab", "embed"),
        r"\.attn\.wq\.weight$": ("heads", "embed"),
        r"\.attn\.w[kv]\.weight$": ("kv_heads", "embed"),
        r"\.attn\.wo\.weight$": ("embed", "heads"),
        r"\.attn\.[qk]_norm\.weight$": ("head_dim",),
        r"\.mlp\.w_(gate|up)\.weight$": ("mlp", "embed"),
        r"\.mlp\.w_down\.weight$": ("embed", "mlp"),
        r"(^|\.)(attn_norm|mlp_norm|norm)\.weight$": ("embed",),
        r"^head\.weight$": ("vocab", "embed"),
    }

    def __init__(self, config: MoEConfig, *, device: _Device = None) -> None:
        super().__init__()
        self.config = config
        target = torch.empty(0, device=device).device
        meta = torch.device("meta")
        self.embed = nn.Embedding(config.vocab_size, config.dim, device=meta)
        self.layers = nn.ModuleList(
            Block(config, i < config.n_dense_layers, device=meta) for i in range(config.n_layers)
        )
        self.norm = RMSNorm(config.dim, config.norm_eps, device=meta)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False, device=meta)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        if target != meta:
            self.to_empty(device=target)
            self.init_weights()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> MoE:
        super()._apply(fn, recurse)
        if self.config.tie_embeddings:  # re-tie after to_empty/.to, as Llama does
            self.head.weight = self.embed.weight
        return self

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Re-initialize every param in place from ``(seed, path)``: norms ones, the router
        bias zeros, the rest normal(0, ``init_std``), output projections (``wo``, ``w_down``,
        ``experts.w_down``) scaled by ``1 / sqrt(2 * n_layers)``.

        Example:
            >>> model = MoE(MoEConfig.tiny(), device="meta").to_empty(device="cpu")
            >>> model.init_weights()
            >>> bool(model.layers[1].mlp.router.expert_bias.eq(0).all())
            True
        """
        seed = self.config.seed if seed is None else seed
        residual_std = self.config.init_std / math.sqrt(2 * self.config.n_layers)
        for path, param in self.named_parameters():
            if path.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if path.endswith("expert_bias"):
                param.zero_()
                continue
            residual = path.endswith((".wo.weight", ".w_down.weight", ".w_down"))
            std = residual_std if residual else self.config.init_std
            generator = torch.Generator().manual_seed(_param_seed(seed, path))
            values = torch.empty(param.shape, dtype=torch.float32)
            param.copy_(values.normal_(0.0, std, generator=generator))

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None
    ) -> MoEModelOutput:
        """Logits, aux loss and expert loads for ``tokens [B, S]``.

        Raises:
            ValueError: ``tokens`` is not 2-d or longer than ``max_seq_len``, or
                ``positions`` is not ``[S]``.
        """
        if tokens.dim() != 2 or tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"MoE expects tokens [batch, seq] with seq <= max_seq_len="
                f"{self.config.max_seq_len}, got {tokens.shape=}."
            )
        seq = tokens.shape[1]
        if positions is None:
            positions = torch.arange(seq, device=tokens.device)
        elif positions.shape != (seq,):
            raise ValueError(f"positions must have shape ({seq},), got {positions.shape=}.")
        x = self.embed(tokens)
        head_dim = self.config.attention_head_dim
        inv_freq = rope_inv_freq(head_dim, self.config.rope_theta, device=x.device)
        cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
        aux_loss = torch.zeros((), dtype=torch.float32, device=x.device)
        loads: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x, aux, load = layer(x, cos, sin)
            if load is not None:
                aux_loss = aux_loss + aux
                loads[f"layers.{i}.mlp"] = load
        return MoEModelOutput(self.head(self.norm(x)), aux_loss, loads)
