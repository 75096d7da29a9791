"""``MoE``: a pre-norm RoPE decoder whose MLPs (after the first ``n_dense_layers``) are
``d9d.moe.MoE`` layers."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import nn

from d9d.moe import MoE as MoELayer

from ..llama._decoder import MLP, Attention, Decoder
from ..llama._decoder import Block as DenseBlock
from ..llama._model import Llama
from ._config import MoEConfig

__all__ = ["MoE", "MoEModelOutput", "MoEState"]

_Device = torch.device | str | None


class MoEModelOutput(NamedTuple):
    """What :class:`MoE` returns."""

    logits: torch.Tensor  # [B, S, vocab_size] in the params' dtype
    aux_loss: torch.Tensor  # 0-d float32: the MoE layers' aux losses summed, to add to the loss
    expert_load: dict[str, torch.Tensor]  # {"layers.{i}.mlp": [E] global choices per expert}


class MoEState(NamedTuple):
    """What each block of :class:`MoE` takes and returns: the residual stream and the running
    balancing statistics. Carried from block to block (and, under ``pipeline``, from stage to
    stage), so that the last block holds the aux loss and the loads of every MoE layer.

    Example:
        >>> config = MoEConfig.tiny()  # block 0 dense, block 1 MoE
        >>> model = MoE(config)
        >>> x, cos, sin = model.embed_and_rope(torch.zeros(1, 4, dtype=torch.long), None)
        >>> state = MoEState(x, torch.zeros(()), torch.zeros(1, config.moe.n_experts))
        >>> for block in model.layers:
        ...     state = block(state, cos, sin)
        >>> state.load.sum().item() == 4 * config.moe.top_k  # every token's top-k choices
        True
    """

    x: torch.Tensor  # [B, S, dim]: the residual stream
    aux_loss: torch.Tensor  # 0-d: the aux losses of the MoE layers so far, summed
    load: torch.Tensor  # [n_moe_layers, E] float32: each MoE layer's global load (0 until it ran)


class Block(DenseBlock):
    """Pre-norm block over a :class:`MoEState`: the MoE layer ``moe_index`` (None: a dense
    MLP) adds its aux loss and writes its load row."""

    def __init__(self, config: MoEConfig, moe_index: int | None, *, device: _Device = None) -> None:
        dense = moe_index is None
        attn = Attention(
            config.dim,
            config.n_heads,
            config.n_kv_heads,
            config.attention_head_dim,
            qk_norm=config.qk_norm,
            norm_eps=config.norm_eps,
            device=device,
        )
        mlp: nn.Module = (
            MLP(config.dim, config.ffn_dim, device=device)
            if dense
            else MoELayer(config.moe, device=device)
        )
        super().__init__(config.dim, config.norm_eps, attn, mlp, device=device)
        # Flags, not isinstance(self.mlp, MLP): a runtime may intercept self.mlp.
        self.dense = dense
        self.moe_index = moe_index

    def forward(self, state: MoEState, cos: torch.Tensor, sin: torch.Tensor) -> MoEState:
        x = state.x + self.attn(self.attn_norm(state.x), cos, sin)
        out = self.mlp(self.mlp_norm(x))
        if self.dense:
            return MoEState(x + out, state.aux_loss, state.load)
        load = state.load.clone()
        load[self.moe_index] = out.load
        return MoEState(x + out.out, state.aux_loss + out.aux_loss, load)


class MoE(Decoder):
    """A DeepSeek/Qwen3-style MoE decoder: ``embed``, ``layers.{i}``, ``norm``, ``head``.

    Block ``i`` holds ``attn_norm``, ``attn.{wq,wk,wv,wo}`` (and ``attn.{q,k}_norm``),
    ``mlp_norm`` and ``mlp``: a dense SwiGLU MLP for ``i < n_dense_layers``, else a
    :class:`d9d.moe.MoE` (``mlp.router.weight``, ``mlp.experts.w_{gate,up,down}``, ...).
    :attr:`logical_axes` names every param's dims; the MoE layers declare theirs. Weights are
    drawn per param from ``(seed, path)`` as in :class:`d9d.models.Llama`; built on the meta
    device nothing is allocated.

    The forward returns :class:`MoEModelOutput`: the logits, the summed aux loss and each MoE
    layer's global expert load, keyed by layer path, which a training step passes to
    :func:`d9d.moe.update_router_bias`. The blocks pass a :class:`MoEState` on (the residual
    stream, the aux loss so far and a load row per MoE layer), so a pipeline stage hands the
    next one the statistics of the blocks before it with the residual stream, and the aux
    loss's gradient comes back to them through autograd (``docs/moe.md``).

    Args:
        config: Shapes, MoE options, init scale and seed.
        device: Where params are created.

    Example:
        >>> model = MoE(MoEConfig.tiny())
        >>> out = model(torch.zeros(2, 8, dtype=torch.long))
        >>> out.logits.shape, list(out.expert_load)
        (torch.Size([2, 8, 256]), ['layers.1.mlp'])
    """

    logical_axes: ClassVar[dict[str, tuple[str | None, ...]]] = Llama.logical_axes | {
        r"\.attn\.[qk]_norm\.weight$": ("head_dim",),
    }

    # The routed experts' w_down is a bare param (no .weight); the router bias starts at 0.
    residual_suffixes = (*Decoder.residual_suffixes, ".w_down")
    zero_suffixes = ("expert_bias",)

    def __init__(self, config: MoEConfig, *, device: _Device = None) -> None:
        def block(i: int, meta: torch.device) -> Block:
            dense = i < config.n_dense_layers
            return Block(config, None if dense else i - config.n_dense_layers, device=meta)

        super().__init__(config, config.attention_head_dim, block, device=device)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None
    ) -> MoEModelOutput:
        """Logits, aux loss and expert loads for ``tokens [B, S]``.

        Raises:
            ValueError: ``tokens`` is not 2-d or longer than ``max_seq_len``, or
                ``positions`` is not ``[S]``.
        """
        x, cos, sin = self.embed_and_rope(tokens, positions)
        config = self.config
        aux_loss = torch.zeros((), dtype=torch.float32, device=x.device)
        shape = (config.n_moe_layers, config.moe.n_experts)
        load = torch.zeros(shape, dtype=torch.float32, device=x.device)
        state = MoEState(x, aux_loss, load)
        for layer in self.layers:
            state = layer(state, cos, sin)
        first = config.n_dense_layers
        loads = {f"layers.{first + j}.mlp": row for j, row in enumerate(state.load.unbind())}
        return MoEModelOutput(self.logits(state.x), state.aux_loss, loads)
